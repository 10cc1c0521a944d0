"""MTP modules of DeepSeek-V3 / GLM-4.5 checkpoints: imported into Megatron's MTP layers,
exported back, and the MTP loss of the imported weights equals DeepSeek-V3's formula.

Tiny checkpoints (tests/test_models.py's deepseek_v3 and glm4_moe, 2 decoder layers) get one
MTP module at HF layer 2, written into the safetensors here (transformers saves none): a
randomised decoder layer of the family (MLA, MoE with shared experts and a router bias; GLM's
partial rotary and qk-norm), random enorm / hnorm / eh_proj / shared_head.norm, and DeepSeek's
copies of embed_tokens and lm_head. Every tensor round-trips bit-exactly through build + export
with and without MTP layers, on one process, TP2 and PP2 (MTP layer on the last stage); a
build asking for more MTP layers than the checkpoint holds is refused in one line.

The reference MTP loss is computed here with transformers' modules only: the main model's
final (normed) hidden state h_i, ``eh_proj([RMSNorm_e(Emb(t_{i+1})); RMSNorm_h(h_i)])``, the
family's decoder layer (built from the config, loaded with the module's weights), shared_head
norm, lm_head, cross-entropy against t_{i+2}; per-token mean over the tokens whose next label
is trained. Packed documents are computed one at a time (the roll must not cross them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import COMMON, FAMILIES, _randomise, _read_export, _write_tokenizer
from trainer_fixtures import run_jobs

WORKER = Path(__file__).with_name("mtp_worker.py")
TOL = 1e-5
MODELS = ("deepseek_v3", "glm4_moe")
BOTH = [{"mtp": 0, "export": True}, {"mtp": 1, "export": True, "losses": True}]
SINGLE_JOBS = [
    {"name": "tp1", "layout": {}, "runs": [{"model": m, **r} for m in MODELS for r in BOTH]},
]
TWO_RANK_JOBS = [
    {"name": "tp2", "layout": {"tp": 2}, "runs": [{"model": "deepseek_v3", **r} for r in BOTH]},
    {"name": "pp2", "layout": {"pp": 2}, "runs": [{"model": "deepseek_v3", "mtp": m, "export": True}
                                                   for m in (0, 1)]},
    {"name": "cp2", "layout": {"cp": 2}, "runs": [{"model": "deepseek_v3", "mtp": 1, "losses": True}]},
]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def make_mtp_checkpoint(directory: Path, config_class: str, overrides: dict, seed: int) -> None:
    """A 2-layer checkpoint in ``directory`` whose third decoder layer (saved by transformers in
    its checkpoint format, every tensor randomised) is the MTP module, with the module's other
    tensors; ``config.json`` declares 2 layers and 1 MTP module."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = getattr(transformers, config_class)(**{**COMMON, **overrides, "num_hidden_layers": 3})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(hf, seed)
    hf.save_pretrained(directory)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(raw))
    path, prefix, h = directory / "model.safetensors", "model.layers.2.", config.hidden_size
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed + 100)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = 1.0 + 0.2 * torch.randn(h, generator=gen)
    tensors[prefix + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=gen)
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _make(root: Path, name: str, seed: int) -> None:
    config_class, overrides = FAMILIES[name]
    make_mtp_checkpoint(root / name, config_class, overrides, seed)
    _write_tokenizer(root / name, overrides["vocab_size"])


def _data() -> dict:
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 150, (2, 17), generator=gen)
    mask = torch.ones(2, 16)
    mask[0, 5] = mask[1, 9] = mask[1, 15] = 0.0  # untrained labels: their MTP tokens drop out
    docs = [torch.randint(0, 150, (n + 1,), generator=gen) for n in (5, 7, 4)]
    return {"rows": rows, "row_mask": mask, "docs": docs, "padded": [8, 8, 4]}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp_hf")
    for seed, name in enumerate(MODELS):
        _make(root, name, 40 + seed)
    torch.save(_data(), root / "data.pt")
    return root


@pytest.fixture(scope="module")
def single(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("mtp_single"), SINGLE_JOBS, 1)


@pytest.fixture(scope="module")
def ranks2(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("mtp_ranks2"), TWO_RANK_JOBS, 2)


# --- reference ------------------------------------------------------------------------------


def _reference_sums(model_dir: Path, data: dict) -> dict[str, tuple[float, float]]:
    """(summed loss, token count) of DeepSeek-V3's MTP depth 1, unpacked rows and packed
    documents (each alone)."""
    import transformers
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config, eps = hf.config, hf.config.rms_norm_eps
    # The module's decoder layer: layer 2 of the same checkpoint read as a 3-layer model.
    layer = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, num_hidden_layers=3).model.layers[2].eval()
    prefix = f"model.layers.{config.num_hidden_layers}."
    module = {k.removeprefix(prefix): v for k, v in load_file(model_dir / "model.safetensors").items()
              if k.startswith(prefix)}

    def sums(tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        with torch.no_grad():
            hidden = hf.model(tokens).last_hidden_state[:, :-1]  # h_i, i = 0 .. n-2
            embed = hf.model.embed_tokens(tokens[:, 1:])  # Emb(t_{i+1})
            x = torch.cat([_rms(embed, module["enorm.weight"], eps),
                           _rms(hidden, module["hnorm.weight"], eps)], dim=-1)
            x = x @ module["eh_proj.weight"].T
            n = x.size(1)
            positions = torch.arange(n)[None]
            causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=causal, position_ids=positions,
                        position_embeddings=hf.model.rotary_emb(x, positions))
            out = out[0] if isinstance(out, tuple) else out
            logits = hf.lm_head(_rms(out, module["shared_head.norm.weight"], eps))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(),
                                                     reduction="none")
            weight = mask[:, 1:].flatten()
        return float((loss * weight).sum()), float(weight.sum())

    rows = data["rows"]
    unpacked = sums(rows[:, :-1], rows[:, 1:], data["row_mask"])
    parts = [sums(d[None, :-1], d[None, 1:], torch.ones(1, len(d) - 1)) for d in data["docs"]]
    return {"unpacked": unpacked, "packed": (sum(p[0] for p in parts), sum(p[1] for p in parts))}


@pytest.fixture(scope="module")
def reference(models) -> dict:
    data = torch.load(models / "data.pt")
    return {name: _reference_sums(models / name, data) for name in MODELS}


# --- tests ----------------------------------------------------------------------------------


def _assert_round_trip(source: Path, export: Path) -> None:
    original, exported = _read_export(source), _read_export(export)
    assert any(".layers.2.eh_proj" in name for name in original)
    assert sorted(exported) == sorted(original)
    different = [name for name in original if not torch.equal(original[name], exported[name])]
    assert not different, different[:5]


def _assert_losses(request, got: dict, want: dict) -> None:
    for kind in ("unpacked", "packed"):
        (loss, count), (ref_loss, ref_count) = got[kind], want[kind]
        assert count == ref_count, (kind, count, ref_count)
        diff = abs(loss / count - ref_loss / ref_count)
        request.node.user_properties.append((f"{kind}_mtp_loss_diff", diff))
        assert diff < TOL, (kind, loss / count, ref_loss / ref_count)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mtp", [0, 1])
def test_tp1_round_trips_the_mtp_module(models, single, model, mtp):
    _assert_round_trip(models / model, single / "tp1" / f"{model}.mtp{mtp}.export")


@pytest.mark.parametrize("model", MODELS)
def test_tp1_mtp_loss_matches_the_formula(request, single, reference, model):
    got = json.loads((single / "tp1" / f"{model}.mtp1.losses.json").read_text())
    _assert_losses(request, got, reference[model])


@pytest.mark.slow
@pytest.mark.parametrize("job,mtp", [("tp2", 0), ("tp2", 1), ("pp2", 0), ("pp2", 1)])
def test_two_ranks_round_trip_the_mtp_module(models, ranks2, job, mtp):
    _assert_round_trip(models / "deepseek_v3", ranks2 / job / f"deepseek_v3.mtp{mtp}.export")


@pytest.mark.slow
@pytest.mark.parametrize("job", ["tp2", "cp2"])
def test_two_ranks_mtp_loss_matches_the_formula(request, ranks2, reference, job):
    got = json.loads((ranks2 / job / "deepseek_v3.mtp1.losses.json").read_text())
    _assert_losses(request, got, reference["deepseek_v3"])


def test_more_mtp_layers_than_the_checkpoint_holds_is_refused(models):
    from hpc_mca.models.errors import ModelLoadError
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.mtp import check_checkpoint

    spec = read_hf_config(models / "deepseek_v3")
    assert (spec.mtp_layers, spec.mtp_copies) == (1, ("embed_tokens.weight", "shared_head.head.weight"))
    with pytest.raises(ModelLoadError) as err:
        check_checkpoint(spec, 2, loading=True)
    message = str(err.value)
    assert "\n" not in message and "model.mtp_num_layers=2" in message and "valid: " in message
    check_checkpoint(spec, 2, loading=False)  # a random init draws them all


def test_a_checkpoint_without_mtp_modules_holds_none(tmp_path):
    """transformers saves num_nextn_predict_layers=1 and no module: nothing to import or export."""
    import transformers

    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.mapping import hf_tensor_shapes

    config_class, overrides = FAMILIES["deepseek_v3"]
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    spec = read_hf_config(tmp_path / "m")
    assert spec.raw["num_nextn_predict_layers"] == 1 and spec.mtp_layers == 0
    assert not any(name.startswith("model.layers.2.") for name in hf_tensor_shapes(spec))
