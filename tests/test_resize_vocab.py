"""``model.resize_vocab``: a template's added tokens grow the model as LLaMA-Factory 0.9.5 grows it.

The new rows are compared with LLaMA-Factory's own ``resize_embedding_layer`` (transformers'
``resize_token_embeddings`` then its noisy-mean init) after ``torch.manual_seed`` with the run's
seed: bit for bit, tied and untied, with and without transformers' multivariate draws. Both
backends train and export the grown model; without the setting, the template's token is named.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import lf_peer  # noqa: F401  (installs LLaMA-Factory's import stubs)
import pytest
import torch
from trainer_fixtures import make_model_dir, make_sft_data, run_train, write_config

from hpc_mca.api.session import check_inputs, model_shape
from hpc_mca.config.loading import load_resolved
from hpc_mca.errors import UserError
from hpc_mca.models.hf_config import read_hf_config
from hpc_mca.models.vocab import grown_rows, grown_size
from hpc_mca.models.vocab_growth import record_vocab_growth, vocab_growth
from hpc_mca.runtime.env import from_environ


def _lf_embedding():
    """LLaMA-Factory's ``model/model_utils/embedding.py``, loaded from its file alone (its
    package's ``__init__`` imports model loading we do not install)."""
    import llamafactory

    path = f"{llamafactory.__path__[0]}/model/model_utils/embedding.py"
    spec = importlib.util.spec_from_file_location("llamafactory.model.model_utils.embedding", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Sized:
    """What LLaMA-Factory's resize reads of a tokenizer: its length."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _tiny_llama(rows: int, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=rows, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


@pytest.mark.parametrize("rows", [102, 40])  # 40 rows < 64 dims: no positive-definite covariance, no draws
@pytest.mark.parametrize("tied", [False, True])
def test_grown_rows_equal_llamafactory_resize(rows: int, tied: bool):
    from torch.distributions import constraints

    model = _tiny_llama(rows, tied)
    embed = model.get_input_embeddings().weight.detach().clone()
    head = None if tied else model.lm_head.weight.detach().clone()
    centered = embed - embed.mean(0)
    definite = bool(constraints.positive_definite.check(1e-9 * centered.T @ centered / rows).all())
    assert definite == (rows > 64)  # both of transformers' branches are exercised
    torch.manual_seed(11)
    _lf_embedding().resize_embedding_layer(model, _Sized(rows + 2))
    grown, grown_head = grown_rows(embed, head, grown_size(rows + 2, rows), seed=11)
    assert model.config.vocab_size == grown.shape[0] == -(-(rows + 2) // 64) * 64
    assert torch.equal(grown, model.get_input_embeddings().weight)
    assert torch.equal(grown[:rows], embed)
    if not tied:
        assert torch.equal(grown_head, model.lm_head.weight)
    other, _ = grown_rows(embed, head, grown.shape[0], seed=12)
    assert not torch.equal(other[rows:], grown[rows:])  # the seed decides the new rows


def _config(root: Path, model: Path, **model_settings):
    train = make_sft_data(root, 16, seed=3, name="train")
    path = write_config(root, model, train, model=model_settings, data={"template": "llama3"},
                        training={"learning_rate": 0.0, "max_steps": 1, "warmup_steps": 0,
                                  "lr_scheduler_type": "constant", "logging_steps": 1})
    return path


def test_a_template_token_past_the_vocabulary_is_named(tmp_path: Path):
    model = make_model_dir(tmp_path)  # the demo tokenizer: 102 tokens, vocab_size 102
    config = load_resolved(_config(tmp_path, model), [], world_size=1)
    with pytest.raises(UserError) as err:
        check_inputs(config, from_environ({}))
    assert str(err.value).splitlines() == [
        f"data.template='llama3' adds the token '<|eot_id|>' to the tokenizer at {model} (id 102, "
        "104 tokens in all), past the model's vocab_size 102; valid: model.resize_vocab: true (grow the "
        "embeddings for the added tokens, as LLaMA-Factory's resize_vocab), or a template whose special "
        "tokens the tokenizer has"]
    assert err.value.on_every_rank and vocab_growth(model) is None  # bad input (exit 2), found by every rank


def test_resize_vocab_is_recorded_for_the_run(tmp_path: Path):
    model = make_model_dir(tmp_path)
    config = check_inputs(load_resolved(_config(tmp_path, model, resize_vocab=True), [], world_size=1),
                          from_environ({}))
    try:
        growth = vocab_growth(model)
        assert (growth.size, growth.seed, len(growth.tokenizer)) == (128, 7, 104)
        assert model_shape(config.model).vocab_size == 128
        spec = read_hf_config(model)
        assert (spec.vocab_size, spec.stored_vocab_size, spec.raw["vocab_size"]) == (128, 102, 128)
    finally:
        record_vocab_growth(model, None)


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


def _reference(model_dir: Path, seed: int):
    """The source model grown by LLaMA-Factory's own resize after ``torch.manual_seed(seed)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    _lf_embedding().resize_embedding_layer(model, _Sized(104))
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("use_mca", "nproc", "tp"), [(False, 1, 1), (True, 1, 1), (True, 2, 2)])
def test_trained_export_is_the_grown_model(tmp_path: Path, use_mca: bool, nproc: int, tp: int):
    """learning_rate 0: the export is the model as the run grew it, on either backend and in any
    tensor-parallel layout: LLaMA-Factory's rows, config.json's vocab_size and the template's
    tokenizer, and transformers' logits of the export are the grown model's."""
    from transformers import AutoTokenizer

    model = make_model_dir(tmp_path)
    config = _config(tmp_path, model, resize_vocab=True)
    run = tmp_path / "run"
    done = run_train(config, run, nproc, f"training.use_mca={str(use_mca).lower()}",
                     f"parallel.tensor_model_parallel_size={tp}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "config.json").read_text())["vocab_size"] == 128
    tokenizer = AutoTokenizer.from_pretrained(run)
    assert len(tokenizer) == 104 and tokenizer.eos_token == "<|eot_id|>"
    want = _reference(model, seed=7)
    from safetensors.torch import load_file

    weights = {k: v for f in sorted(run.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert torch.equal(weights["model.embed_tokens.weight"], want.model.embed_tokens.weight)
    assert torch.equal(weights["lm_head.weight"], want.lm_head.weight)
    ids = torch.tensor([tokenizer.encode("1+1=2<|eot_id|>", add_special_tokens=False)])
    assert int(ids.max()) >= 102  # a grown row is read
    with torch.no_grad():
        torch.testing.assert_close(_logits(run, ids), want(ids).logits, rtol=0, atol=1e-5)


def test_resize_vocab_with_lora_is_refused(tmp_path: Path):
    from hpc_mca.config.input import ConfigError

    model = make_model_dir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_resolved(_config(tmp_path, model, resize_vocab=True), ["finetuning_type=lora"], world_size=1)
    assert "model.resize_vocab=true with finetuning.finetuning_type='lora'" in str(err.value)
