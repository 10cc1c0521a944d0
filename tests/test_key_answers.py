"""Every key of LLaMA-Factory 0.9.5's argument classes and of transformers'
``Seq2SeqTrainingArguments`` has one answer here (hpc_mca/config/key_answers.py): honoured (a
field of this config), translated (LF_KEYS) or refused (its default accepted, any other value
refused in one line naming the key, the value and what replaces it); the table on
docs/llama-factory-keys.md is the rendered one."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import lf_peer
import pytest
from transformers import Seq2SeqTrainingArguments

from hpc_mca.config.key_answers import REFUSED, answer, readme_table
from hpc_mca.config.lf_keys import LF_KEYS
from hpc_mca.config.loading import load_items
from hpc_mca.config.sections import field_section

KEY_PAGE = Path(__file__).resolve().parent.parent / "docs" / "llama-factory-keys.md"


def _lf_module(name: str) -> ModuleType:
    """One of LLaMA-Factory's hparams modules, loaded from its file alone: the package's
    ``__init__`` runs its dependency check, which pins an older transformers."""
    import llamafactory

    dotted = f"llamafactory.hparams.{name}"
    if dotted not in sys.modules:
        spec = importlib.util.spec_from_file_location(dotted, f"{llamafactory.__path__[0]}/hparams/{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[dotted] = module
        spec.loader.exec_module(module)
    return sys.modules[dotted]


def _classes() -> list[type]:
    return [_lf_module("model_args").ModelArguments, lf_peer.DataArguments,
            _lf_module("finetuning_args").FinetuningArguments, Seq2SeqTrainingArguments,
            _lf_module("training_args").TrainingArguments]


def _defaults(cls: type) -> dict[str, object]:
    """The fields a user may write (HfArgumentParser reads only init fields), with their defaults
    as YAML writes them (an enum as its value)."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        out[f.name] = value.value if isinstance(value, enum.Enum) else value
    return out


FIELDS: dict[str, object] = {}
for _cls in _classes():
    FIELDS.update({name: value for name, value in _defaults(_cls).items() if name not in FIELDS})
"""Every key of the classes -> its default (the first class that has it)."""


def _without_answer(names: list[str]) -> list[str]:
    return [name for name in names if answer(name) is None]


def test_every_field_has_a_specific_answer():
    assert len(FIELDS) > 300  # the walk really sees the classes (their mixins included)
    assert _without_answer(list(FIELDS)) == []


def test_the_walk_fails_on_a_field_without_an_answer():
    """A key a later LLaMA-Factory adds, or one dropped from the table, is reported."""
    @dataclasses.dataclass
    class Newer:
        cutoff_len: int = 1024
        use_dora: bool = False
        packing: bool | None = None
        sparse_attention_mode: str = "off"

    assert _without_answer(list(_defaults(Newer))) == ["sparse_attention_mode"]
    assert [answer(name)[0] for name in ("cutoff_len", "packing", "use_dora")] == [  # type: ignore[index]
        "honoured", "translated", "refused"]


def test_the_refused_keys_are_the_classes_keys_with_their_defaults():
    """No stale entry, no key that is also honoured or translated, and the value accepted is the
    classes' default (so a YAML copied from LLaMA-Factory, defaults and all, loads)."""
    assert sorted(set(REFUSED) - set(FIELDS)) == []
    assert [name for name in REFUSED if field_section(name) or name in LF_KEYS] == []
    assert {name: family.defaults[name] for name, family in REFUSED.items()} == {
        name: FIELDS[name] for name in REFUSED}
    config, problems = load_items([(name, FIELDS[name], None) for name in REFUSED])
    assert problems == []
    assert config == load_items([])[0]  # nothing set


@pytest.mark.parametrize("key, value, replacement", [
    ("use_dora", True, "no DoRA here"),
    ("run_name", "exp1", "trackers name the run after output_dir's last directory"),
    ("neftune_noise_alpha", 5, "no NEFTune noise on the embeddings here"),
    ("galore_rank", 8, "training.optim: adam or sgd"),
    ("push_to_hub", True, "nothing is downloaded or uploaded here"),
    ("fsdp", "full_shard", "Megatron-Core's parallelism replaces it"),
    ("preserve_thinking", True, "reasoning templates drop earlier answers' thoughts"),
    ("export_size", 2, "LLaMA-Factory's export stage: use hpc-mca export"),
    ("video_max_pixels", 1000, "videos and audios are not supported (images are"),
    ("training.swanlab_project", "p", "SwanLab is not a tracker here"),
])
def test_another_value_is_refused_in_one_line(key: str, value: object, replacement: str):
    name = key.rpartition(".")[2]
    _, problems = load_items([("cutoff_len", 512, None), (key, value, None)])
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert problems[0].startswith(f"{name}={value!r} is not supported: {replacement}")
    assert problems[0].endswith("(its default), or remove the key")
    assert REFUSED[name].why in problems[0]


def test_a_later_default_clears_an_earlier_refusal():
    assert load_items([("use_dora", True, None), ("use_dora", False, None)])[1] == []


def test_the_key_table_page_is_the_rendered_one():
    text = KEY_PAGE.read_text()
    start = text.index("<!-- key table: hpc_mca.config.key_answers.readme_table() -->\n")
    body = text[text.index("\n", start) + 1:text.index("<!-- end of the key table -->")]
    assert body == readme_table(), "docs/llama-factory-keys.md's table is stale: regenerate it (see the page)"


# --- LLaMA-Factory's data keys: the default dataset_dir, multimodal columns -----------------------

def test_without_dataset_dir_a_name_is_looked_up_in_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """LLaMA-Factory's dataset_dir defaults to ``data`` under the working directory; a name that
    is neither a file nor an entry there is refused saying where it looked and what is valid."""
    from hpc_mca.data.arguments import DataArguments
    from hpc_mca.data.errors import DataError
    from hpc_mca.data.sources import resolve_sources

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        resolve_sources(DataArguments(dataset=["identity"]))
    assert str(err.value) == (
        "data.dataset: 'identity' is neither a file nor a dataset_info.json entry: data.dataset_dir is "
        f"unset and LLaMA-Factory's default, data/ under the working directory ({tmp_path / 'data'}), has "
        "no dataset_info.json; valid: a data file or directory, or data.dataset_dir set to the directory "
        "whose dataset_info.json lists it")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"identity": {"file_name": "id.json"}}))
    (source,) = resolve_sources(DataArguments(dataset=["identity"]))
    assert (source.path, source.formatting) == (str(tmp_path / "data" / "id.json"), "alpaca")
    with pytest.raises(DataError) as err:
        resolve_sources(DataArguments(dataset=["alpaca_en_demo"]))
    assert str(err.value) == (
        f"data.dataset: 'alpaca_en_demo' is neither a file nor an entry of {tmp_path / 'data'}/dataset_info.json "
        "(data.dataset_dir unset: LLaMA-Factory's default 'data'); valid: identity")
    (tmp_path / "identity").write_text("")  # a file of that name is the file, as before
    assert resolve_sources(DataArguments(dataset=["identity"]))[0].path == "identity"


def test_videos_are_refused_in_one_line(tmp_path: Path):
    from hpc_mca.data.arguments import DataArguments
    from hpc_mca.data.conversation import example_of
    from hpc_mca.data.errors import DataError
    from hpc_mca.data.records import Record
    from hpc_mca.data.sources import resolve_sources

    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"mllm_demo": {"file_name": "mllm.json", "formatting": "sharegpt",
                       "columns": {"messages": "messages", "videos": "videos"}}}))
    with pytest.raises(DataError) as err:
        resolve_sources(DataArguments(dataset=["mllm_demo"], dataset_dir=str(tmp_path)))
    assert str(err.value) == (
        f"{tmp_path}/dataset_info.json: dataset 'mllm_demo': columns.videos: videos and audios are not "
        "supported (images are, with a vision-language template: qwen2_vl, qwen3_vl, qwen3_vl_nothink); "
        "valid: messages, system, tools, chosen, rejected, kto_tag, images")
    record = Record("mllm.json:1", {"instruction": "<video>What is it?", "output": "a cat",
                                    "videos": ["cat.mp4"]})
    with pytest.raises(DataError) as err:
        example_of(record, "alpaca", ranking=False)
    assert str(err.value) == ("mllm.json:1: 'videos': videos and audios are not supported (images are, with a "
                              "vision-language template: qwen2_vl, qwen3_vl, qwen3_vl_nothink); valid: records "
                              "without 'videos' (or an empty list)")
    assert example_of(Record("a:1", {"instruction": "q", "output": "a", "videos": []}), "alpaca", False)
