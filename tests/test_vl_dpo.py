"""dpo with images (issue #63) on the Megatron backend: preference pairs with ``images`` give
LLaMA-Factory 0.9.5's pairwise samples (its pairwise processor with the Qwen2-VL / Qwen3-VL
plugins: token ids, labels, grids, pixels), the chosen and the rejected sample each carry the
pair's image tokens and pixels, bad pairs are one line naming the record, and a LoRA dpo on the
demo's preference pairs (hpc_mca/assets/demo_vl, ``shapes_pref``) starts at ln 2 and gives
the same first step packed and unpacked; a full fine-tuning dpo (a reference copy)
starts at ln 2 too; the standard backend's first step equals the Megatron backend's. kto with
images is refused in one line.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from lf_peer import lf_data_args, lf_get_template_and_fix_tokenizer, lf_pairwise
from test_vl_data import PROCESSORS, _draw, _lf_processor, _model_dir
from vl_fixtures import DEMO, LORA, demo_model_dir, train, write_config

from hpc_mca.data.arguments import DataArguments, DataRun
from hpc_mca.data.batch import collate_batch
from hpc_mca.data.conversation import Example
from hpc_mca.data.dataset import build_datasets
from hpc_mca.data.encode import prepare_template
from hpc_mca.data.errors import DataError
from hpc_mca.data.multimodal import vision_inputs, vision_pairwise
from hpc_mca.data.tokenize import load_tokenizer
from hpc_mca.data.vision import ImageSettings, image_inputs


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("images")
    sizes = [((56, 56), "RGB"), ((100, 37), "RGBA"), ((300, 20), "L"), ((1000, 800), "P")]
    return [_draw(root / f"{i}.png", size, mode, i) for i, (size, mode) in enumerate(sizes)]


def _pairs(images: list[str]) -> list[tuple[list[dict], list[dict], list[str], str]]:
    """(prompt, [chosen, rejected], images, system): one image, two in one turn, images over
    the history and the last turn, an image in the answers, none, a long answer (cut to a
    cutoff_len of 120, its image kept)."""
    def turn(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    return [
        ([turn("user", "<image>What is this?")], [turn("assistant", "a box"), turn("assistant", "a long cat")],
         images[:1], ""),
        ([turn("user", "Compare <image> and <image>, please")], [turn("assistant", "same"), turn("assistant", "no")],
         images[1:3], "look closely"),
        ([turn("user", "<image>first"), turn("assistant", "one"), turn("user", "then <image>")],
         [turn("assistant", "two"), turn("assistant", "three things")], [images[3], images[0]], ""),
        ([turn("user", "look")], [turn("assistant", "<image>here"), turn("assistant", "there <image>")],
         images[:1], ""),
        ([turn("user", "no image here")], [turn("assistant", "fine"), turn("assistant", "bad")], [], ""),
        ([turn("user", "<image>short")], [turn("assistant", "yes"), turn("assistant", "no, " * 40)], images[:1], ""),
    ]


@pytest.mark.parametrize("family", sorted(PROCESSORS))
@pytest.mark.parametrize("cutoff_len", [4096, 120])
def test_pairs_grids_and_pixels_equal_llamafactorys(family, cutoff_len, images, tmp_path):
    template_name = PROCESSORS[family][0]
    model = _model_dir(tmp_path, family)
    settings = ImageSettings(max_pixels=200 * 200, min_pixels=32 * 32)
    base = load_tokenizer(model)
    ours_tok, lf_tok = copy.deepcopy(base), copy.deepcopy(base)
    template = prepare_template(ours_tok, DataArguments(template=template_name))
    vision = vision_inputs(ours_tok, template, model, settings)
    lf_template = lf_get_template_and_fix_tokenizer(lf_tok, template=template_name)
    processor = _lf_processor(vision.processor, settings)
    lf = lf_pairwise.PairwiseDatasetProcessor(template=lf_template, tokenizer=lf_tok, processor=processor,
                                              data_args=lf_data_args(template=template_name, cutoff_len=cutoff_len))
    compared = 0
    for prompt, answers, paths, system in _pairs(images):
        example = Example("memory", prompt, answers, system, "", tuple(paths))
        expected = lf._encode_data_example(prompt, answers, system or None, None, paths, [], [])
        try:
            chosen, rejected = vision_pairwise(template, ours_tok, example, cutoff_len, vision)
        except DataError as err:  # only where LLaMA-Factory would cut image tokens
            assert cutoff_len < 4096 and "of which fit data.cutoff_len" in str(err)
            kept = [ids.count(vision.image_token_id) for ids in expected[::2]]
            assert min(kept) < int(vision.grids(tuple(paths), "x").prod(axis=1).sum()) // 4
            continue
        compared += 1
        assert (chosen.tokens, chosen.labels, rejected.tokens, rejected.labels) == expected
        if not paths:
            assert chosen.images == rejected.images == ()
            continue
        pixels, grids = vision.pixels(tuple(paths), "memory")
        lf_inputs = lf_template.mm_plugin._get_mm_inputs(paths, [], [], processor)
        assert np.array_equal(grids, lf_inputs["image_grid_thw"].numpy())
        assert np.array_equal(pixels, lf_inputs["pixel_values"].numpy())
        for built in (chosen, rejected):
            assert built.images == tuple(paths) and [tuple(g) for g in grids.tolist()] == list(built.grids)
            assert built.tokens.count(vision.image_token_id) == int(grids.prod(axis=1).sum()) // 4
    assert compared >= (6 if cutoff_len == 4096 else 2)


# --- the pipeline: dataset_info entries, rows, refusals -----------------------------------


def _build(tmp_path: Path, name: str, data_dir: Path = DEMO / "data", stage: str = "dpo",
           **settings) -> object:
    data = DataArguments(dataset=[name], dataset_dir=str(data_dir), template="qwen2_vl",
                         preprocessing_cache_dir=str(tmp_path / "cache"), **settings)
    run = DataRun(stage=stage, seed=0, seq_length=data.seq_length or data.cutoff_len, global_batch_size=2,
                  tokenizer_path=str(DEMO))
    return build_datasets(data, run)


@pytest.mark.parametrize("packed", [False, True])
def test_both_rows_of_a_pair_carry_its_images_in_token_order(tmp_path, packed):
    rows = _build(tmp_path, "shapes_pref", cutoff_len=128, seq_length=256 if packed else 128,
                  sequence_packing=packed).train
    assert rows.samples.stats["pairs"] == 60 and rows.samples.stats["images"] == 60
    vision = rows.vision
    items = [rows[0], rows[1]]
    batch = (type(rows).collate(items) if not packed else collate_batch(items))
    samples = ([2 * i + k for i in (0, 1) for k in (0, 1)] if not packed
               else [s for r in (0, 1) for s in rows.rows[r]])
    paths = [p for s in samples for p in rows.samples.images(s)[0]]
    assert paths[0::2] == paths[1::2]  # chosen and rejected: the same image, once each
    pixels, grids = image_inputs(vision.processor, paths, vision.settings, "test")
    assert torch.equal(batch.pixel_values, torch.from_numpy(pixels))
    assert torch.equal(batch.image_grid_thw, torch.from_numpy(grids))
    assert int((batch.input_ids == vision.image_token_id).sum()) == int(grids.prod(axis=1).sum()) // 4
    assert batch.num_documents == len(samples) and batch.mrope_position_ids.shape[0] == 3


def _pref_copy(tmp_path: Path, records: list[dict], fmt: str = "sharegpt") -> Path:
    data = tmp_path / "data"
    shutil.copytree(DEMO / "data", data)
    (data / "bad.json").write_text(json.dumps(records))
    info = json.loads((data / "dataset_info.json").read_text())
    info["bad"] = ({**info["shapes_pref"], "file_name": "bad.json"} if fmt == "sharegpt" else
                   {"file_name": "bad.json", "ranking": True, "columns": {
                       "prompt": "instruction", "chosen": "chosen", "rejected": "rejected", "images": "images"}})
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def _pair(question: str, images: list[str], chosen: str = "red", rejected: str = "blue") -> dict:
    return {"messages": [{"role": "user", "content": question}], "chosen": {"role": "assistant", "content": chosen},
            "rejected": {"role": "assistant", "content": rejected}, "images": images}


GOOD = "images/red_square_56x56.png"


def test_alpaca_pairs_with_images_equal_sharegpt_ones(tmp_path):
    alpaca = [{"instruction": "<image>colour?", "chosen": "red", "rejected": "blue", "images": [GOOD]}]
    a = _build(tmp_path / "a", "bad", _pref_copy(tmp_path / "a", alpaca, "alpaca"), cutoff_len=128).train
    s = _build(tmp_path / "s", "bad", _pref_copy(tmp_path / "s", [_pair("<image>colour?", [GOOD])]),
               cutoff_len=128).train
    for left, right in zip(a[0], s[0]):
        assert all(torch.equal(left[k], right[k]) for k in left)
    assert a[0][0]["image_grid_thw"].tolist() == a[0][1]["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.parametrize(("records", "message"), [
    ([_pair("<image>colour?", [GOOD]), _pair("<image>colour?", ["images/nope.png"])],
     r"bad.json:record 2: image 'images/nope.png' does not exist"),
    ([_pair("<image><image>colour?", [GOOD])],
     r"bad.json:record 1: 2 <image> placeholder\(s\) in the turns but 1 image\(s\)"),
    ([_pair("colour?", [GOOD], chosen="<image>red")],
     r"bad.json:record 1: 0 <image> placeholder\(s\) in the turns but 1 image\(s\)"),
    ([_pair("a long question first " * 2 + "<image>", ["images/red_square_84x56.png"])],
     r"bad.json:record 1: its 1 image\(s\) take 6 image tokens, \d of which fit data.cutoff_len=60"),
])
def test_bad_pairs_are_one_line_naming_the_record(records, message, tmp_path):
    with pytest.raises(DataError, match=message) as err:
        _build(tmp_path, "bad", _pref_copy(tmp_path, records), cutoff_len=60)
    assert "\n" not in str(err.value)


def test_kto_with_images_is_refused_in_one_line(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DEMO / "data", data)
    record = {"messages": [{"role": "user", "content": "<image>colour?"}, {"role": "assistant", "content": "red"}],
              "label": True, "images": [GOOD]}
    (data / "kto.json").write_text(json.dumps([record, {**record, "label": False}]))
    info = json.loads((data / "dataset_info.json").read_text())
    info["kto"] = {**info["shapes"], "file_name": "kto.json",
                   "columns": {"messages": "messages", "kto_tag": "label", "images": "images"}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"kto.json:record 1: the record has 1 image\(s\) but images train "
                                        r"with finetuning.stage 'sft' or 'dpo' only") as err:
        _build(tmp_path, "kto", data, stage="kto", cutoff_len=128)
    assert "\n" not in str(err.value)


# --- training on the Megatron backend -----------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return demo_model_dir(tmp_path_factory.mktemp("vl_model"))


def _config(root: Path, model_dir: Path, **settings: object) -> Path:
    config = {
        "model_name_or_path": str(model_dir), "stage": "dpo", "template": "qwen2_vl", "use_mca": True,
        "dataset": "shapes_pref", "dataset_dir": str(DEMO / "data"), "cutoff_len": 128,
        "seq_length": 256, "sequence_packing": True, "per_device_train_batch_size": 2,
        "global_batch_size": 4, "learning_rate": 5e-3, "lr_scheduler_type": "constant",
        "pref_beta": 0.5, "max_steps": 12, "logging_steps": 1, "seed": 11, "output_dir": str(root / "run"),
        **settings,
    }
    return write_config(root, config)


@pytest.mark.slow
def test_a_lora_dpo_on_the_demo_pairs_starts_at_ln2(tmp_path, model_dir):
    curve = train(_config(tmp_path, model_dir, **LORA, max_steps=4), tmp_path / "run", 1)
    assert len(curve) == 4 and all(s["pairs"] == 4 for s in curve)
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert curve[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert all(math.isfinite(s["loss"]) for s in curve) and any(s["rewards/margins"] != 0.0 for s in curve[1:])


@pytest.mark.slow
@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_packed_and_unpacked_pairs_give_the_same_first_step(tmp_path, model_dir, finetuning):
    settings = LORA if finetuning == "lora" else {"finetuning_type": "full"}
    # 4 pairs: one step holds them all, packed (two pairs a row) or not (a pair a micro-batch)
    config = _config(tmp_path, model_dir, max_steps=1, max_samples=4, **settings)
    packed = train(config, tmp_path / "packed", 1)[0]
    rows = train(config, tmp_path / "rows", 1, "data.sequence_packing=false")[0]
    assert packed["pairs"] == rows["pairs"] == 4
    assert packed["loss"] == pytest.approx(math.log(2), abs=1e-4)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert rows[key] == pytest.approx(packed[key], abs=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_the_standard_backends_first_step_equals_megatrons(tmp_path, model_dir, finetuning):
    """The same 4 pairs (max_samples=4, one step) on both backends: transformers' Qwen2-VL with
    its vision tower under the standard backend's dpo gives Megatron's loss (ln 2), rewards and
    log-probabilities of the chosen and rejected answers."""
    settings = LORA if finetuning == "lora" else {"finetuning_type": "full"}
    config = _config(tmp_path, model_dir, max_steps=1, max_samples=4, **settings)
    megatron = train(config, tmp_path / "megatron", 1)[0]
    standard = train(config, tmp_path / "standard", 1, "training.use_mca=false")[0]
    assert megatron["pairs"] == standard["pairs"] == 4
    assert standard["loss"] == pytest.approx(math.log(2), abs=1e-5)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                "logps/rejected"):
        assert standard[key] == pytest.approx(megatron[key], abs=1e-5), key
