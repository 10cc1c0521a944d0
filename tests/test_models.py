"""HF <-> Megatron model parity with real ranks: logits against transformers for every family
in TP=1, TP=2, PP=2 (also interleaved and uneven) and EP=2; import -> export round trips; packed
sequences against documents run alone; a rank reads only the shards it needs.

Tiny random models (2 layers, hidden 64, 4 heads, 2 KV heads) are made with transformers and
``save_pretrained``; every weight, norms and biases included, is randomised so that a mapping
mistake cannot hide behind ones and zeros. All layouts and families of one world size run in
one launch of tests/models_worker.py (one process, or torchrun with 2 gloo ranks); the tests
then read what the ranks saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_fixtures import run_jobs

WORKER = Path(__file__).with_name("models_worker.py")
TOL = 1e-4
PACKED_TOL = 1e-5

COMMON = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64}
FAMILIES = {
    # name: (config class, overrides); vocabularies chosen to hit every vocab-padding case
    "llama": ("LlamaConfig", dict(vocab_size=200, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("Qwen2Config", dict(vocab_size=256, tie_word_embeddings=True)),
    # yarn: its attention factor (1.14 here) scales q.k, through Megatron's softmax scale
    "qwen3": ("Qwen3Config", dict(vocab_size=130, head_dim=32, tie_word_embeddings=True,
                                  rope_parameters=YARN_ROPE)),
    "mistral": ("MistralConfig", dict(vocab_size=255)),  # sliding_window 4096 >= 256: inert
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=160, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32)),
    "mixtral": ("MixtralConfig", dict(vocab_size=128, num_local_experts=4, num_experts_per_tok=2)),
    # q/k/v biases (attention_bias), head_dim 32 != 64/4; residual_dropout (default 0.1) is refused
    "seed_oss": ("SeedOssConfig", dict(vocab_size=129, head_dim=32, residual_dropout=0.0)),
    # a shared expert behind a sigmoid gate; layer 0 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeConfig", dict(vocab_size=140, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         mlp_only_layers=[0])),
    # partial rotary, q/k/v biases, qk-norm, first layer dense, sigmoid router with a bias,
    # groups (2 of 4 experts each, 1 picked), routed_scaling_factor, two shared experts
    "glm4_moe": ("Glm4MoeConfig", dict(vocab_size=150, n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=24, n_shared_experts=2,
                                       first_k_dense_replace=1, n_group=2, topk_group=1,
                                       routed_scaling_factor=2.5, partial_rotary_factor=0.5,
                                       attention_bias=True, use_qk_norm=True, head_dim=32)),
    # multi-latent attention (q and kv latents, a decoupled rope head, value heads narrower
    # than query heads), yarn with DeepSeek's mscale pair, first layer dense, sigmoid groups
    "deepseek_v3": ("DeepseekV3Config", dict(
        vocab_size=170, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, num_key_value_heads=4,
        rope_parameters={**YARN_ROPE, "mscale": 0.8, "mscale_all_dim": 0.9})),
}
MOE = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
DENSE = [name for name in FAMILIES if name not in MOE]
EXTRA = {
    "llama_sharded": ("LlamaConfig", dict(vocab_size=200), "24KB"),
    "llama4": ("LlamaConfig", dict(vocab_size=200, num_hidden_layers=4), None),
    # stored in bfloat16, run in float32: import upcasts exactly, export writes bfloat16 back
    "llama_bf16": ("LlamaConfig", dict(vocab_size=200), None),
    # multi-latent attention without a query latent (a plain q_proj), default rope
    "deepseek_v3_q_proj": ("DeepseekV3Config", {
        **FAMILIES["deepseek_v3"][1], "q_lora_rank": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, None),
}
SINGLE_ONLY = ["llama_sharded", "llama_bf16", "deepseek_v3_q_proj"]

SINGLE_JOBS = [
    {"name": "tp1", "layout": {}, "models": [*FAMILIES, *SINGLE_ONLY], "attention_grads": True,
     "export": True, "packed": True},
]
TORCHRUN_JOBS = [
    {"name": "tp2", "layout": {"tp": 2}, "models": list(FAMILIES), "export": True,
     "attention_grads": True},
    {"name": "pp2", "layout": {"pp": 2}, "models": [*FAMILIES, "llama_sharded"], "export": True,
     "opened": True, "shard_bytes": 64 * 1024},
    {"name": "ep2", "layout": {"ep": 2}, "models": MOE, "export": True},
    # each rank runs its two load-balanced quarters of the sequence
    {"name": "cp2", "layout": {"cp": 2}, "models": ["llama", *MOE]},
    {"name": "pp2vp2", "layout": {"pp": 2, "vp": 2}, "models": ["llama4"], "export": True},
    {"name": "pp2uneven", "layout": {"pp": 2, "pipeline_layout": [1, 3]}, "models": ["llama4"]},
]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            is_norm = name.endswith("norm.weight")
            param.copy_(1.0 + 0.2 * noise if is_norm else 0.1 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the sigmoid router's choice
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def _write_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>").save_pretrained(directory)


def _make_model(root: Path, name: str, config_class: str, overrides: dict, shard: str | None,
                seed: int) -> None:
    import transformers

    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model, seed)
    if name.endswith("_bf16"):
        model.to(torch.bfloat16)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(root / name, **kwargs)
    _write_tokenizer(root / name, config.vocab_size)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """HF model directories plus ``inputs.pt`` and transformers' logits ``<name>.ref.pt``."""
    import transformers

    root = tmp_path_factory.mktemp("hf")
    specs = {name: (*spec, None) for name, spec in FAMILIES.items()} | EXTRA
    for seed, (name, (config_class, overrides, shard)) in enumerate(specs.items()):
        _make_model(root, name, config_class, overrides, shard, seed)
    inputs = torch.randint(0, 1 << 16, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(inputs, root / "inputs.pt")
    for name in specs:
        hf = transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)
        with torch.no_grad():
            torch.save(hf(inputs % hf.config.vocab_size).logits, root / f"{name}.ref.pt")
    return root


@pytest.fixture(scope="module")
def single(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("single"), SINGLE_JOBS, 1)


@pytest.fixture(scope="module")
def ranks2(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("ranks2"), TORCHRUN_JOBS, 2)


@pytest.fixture(scope="module")
def ranks4(models, tmp_path_factory) -> Path:
    return run_jobs(WORKER, models, tmp_path_factory.mktemp("ranks4"), FOUR_RANK_JOBS, 4)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got.cpu().float() - want.cpu().float()).abs().max().item()


def _read_export(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _record(request, key: str, value: float) -> None:
    """Figures for the report: pytest -rA shows them with the test id."""
    request.node.user_properties.append((key, value))


# --- logits parity ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", [*FAMILIES, *SINGLE_ONLY])
def test_tp1_logits_match_transformers(request, models, single, family):
    diff = _max_diff(torch.load(single / "tp1" / f"{family}.logits.pt"),
                     torch.load(models / f"{family}.ref.pt"))
    _record(request, "max_abs_diff", diff)
    assert diff < TOL


FOUR_RANK_JOBS = [
    # dense weights replicated over DP=2 (only the first replica exports), experts over EP=2
    {"name": "tp2ep2", "layout": {"tp": 2, "ep": 2}, "models": MOE, "export": True},
    # expert tensor parallelism: each expert's fc1/fc2 split over ETP=2 as well
    {"name": "tp2ep2etp2", "layout": {"tp": 2, "ep": 2, "etp": 2}, "models": MOE, "export": True},
]
PARITY_CASES = [(job["name"], model) for job in TORCHRUN_JOBS for model in job["models"]]
FOUR_RANK_CASES = [(job["name"], model) for job in FOUR_RANK_JOBS for model in job["models"]]


@pytest.mark.slow
@pytest.mark.parametrize("job,family", PARITY_CASES, ids=[f"{j}-{m}" for j, m in PARITY_CASES])
def test_multi_rank_logits_match_transformers(request, models, ranks2, job, family):
    diff = _max_diff(torch.load(ranks2 / job / f"{family}.logits.pt"),
                     torch.load(models / f"{family}.ref.pt"))
    _record(request, "max_abs_diff", diff)
    assert diff < TOL


LOSS_CASES = [pytest.param("tp1", m, id=f"tp1-{m}") for m in FAMILIES] + [
    pytest.param("tp2", m, id=f"tp2-{m}", marks=pytest.mark.slow) for m in FAMILIES
]


@pytest.mark.parametrize("job,family", LOSS_CASES)
def test_per_token_loss_matches_transformers_cross_entropy(request, models, job, family):
    """Megatron's cross-entropy runs over the padded vocabulary (V rounded up to 128·TP): equal
    to transformers' only because the padding logits are masked to the dtype's minimum."""
    out = request.getfixturevalue("single" if job == "tp1" else "ranks2")
    logits = torch.load(models / f"{family}.ref.pt")
    labels = torch.load(models / "inputs.pt") % logits.size(-1)
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="none"
    ).view(labels.size(0), -1)
    diff = _max_diff(torch.load(out / job / f"{family}.loss.pt"), want)
    _record(request, "loss_diff", diff)
    assert diff < TOL


@pytest.mark.slow
@pytest.mark.parametrize("job,family", FOUR_RANK_CASES, ids=[f"{j}-{m}" for j, m in FOUR_RANK_CASES])
def test_four_rank_moe_logits_match_and_export_round_trips(request, models, ranks4, job, family):
    diff = _max_diff(torch.load(ranks4 / job / f"{family}.logits.pt"),
                     torch.load(models / f"{family}.ref.pt"))
    _record(request, "max_abs_diff", diff)
    assert diff < TOL
    _assert_round_trip(models / family, ranks4 / job / f"{family}.export")


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_attention_gradients_on_tp2_equal_one_process(single, ranks2, family):
    """Backward through attention split over TP: multi-latent attention's rope key is one head
    shared by all (hpc_mca.models.mla sums its gradient over the ranks' heads). Raw gradients,
    before finalize_model_grads: families with per-head qk-norm leave those partial per rank
    for it to sum, so they are not compared here."""
    one = torch.load(single / "tp1" / f"{family}.attention_grads.pt")
    two = torch.load(ranks2 / "tp2" / f"{family}.attention_grads.pt")
    assert sorted(one) == sorted(two)
    for name in one:
        assert _max_diff(two[name], one[name]) < 1e-5, name


# --- export round trip -----------------------------------------------------------------------


def _assert_round_trip(source: Path, export: Path) -> None:
    original, exported = _read_export(source), _read_export(export)
    assert sorted(exported) == sorted(original)
    different = [name for name in original if not torch.equal(original[name], exported[name])]
    assert not different, different[:5]
    assert all(exported[name].dtype == original[name].dtype for name in original)


@pytest.mark.parametrize("family", [*FAMILIES, *SINGLE_ONLY])
def test_tp1_export_round_trips_every_tensor_bit_exactly(models, single, family):
    _assert_round_trip(models / family, single / "tp1" / f"{family}.export")


EXPORT_CASES = [(job["name"], m) for job in TORCHRUN_JOBS if job.get("export") for m in job["models"]]


@pytest.mark.slow
@pytest.mark.parametrize("job,family", EXPORT_CASES, ids=[f"{j}-{m}" for j, m in EXPORT_CASES])
def test_multi_rank_export_round_trips_every_tensor_bit_exactly(models, ranks2, job, family):
    _assert_round_trip(models / family, ranks2 / job / f"{family}.export")


@pytest.mark.slow
@pytest.mark.parametrize("job,family", [("tp2", "llama"), ("pp2", "qwen3"), ("ep2", "mixtral"),
                                        ("tp2", "deepseek_v3"), ("pp2", "glm4_moe"),
                                        ("ep2", "qwen2_moe")])
def test_transformers_loads_the_export_with_the_same_logits(models, ranks2, job, family):
    import transformers

    export = ranks2 / job / f"{family}.export"
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    inputs = torch.load(models / "inputs.pt") % hf.config.vocab_size
    with torch.no_grad():
        logits = hf(inputs).logits
    assert torch.equal(logits, torch.load(models / f"{family}.ref.pt"))
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == family and config["dtype"] == "float32"
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer("t1 t2")["input_ids"] == [1, 2]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exports_carry_the_tokenizer_and_generation_config(models, family, tmp_path):
    """What every export of both backends holds beside its weights: the source's tokenizer
    files and generation_config.json byte for byte; a source without a generation config gets
    the one transformers writes for the model it loads from there (from config.json)."""
    import shutil

    import transformers

    from hpc_mca.models.export import write_companion_files

    source, copied, derived = tmp_path / "source", tmp_path / "copied", tmp_path / "derived"
    shutil.copytree(models / family, source)
    (source / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.6}\n')
    copied.mkdir()
    write_companion_files(copied, source)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (copied / name).read_bytes() == (source / name).read_bytes(), name

    (source / "generation_config.json").unlink()
    derived.mkdir()
    write_companion_files(derived, source)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source)
    hf.save_pretrained(tmp_path / "reference")
    assert (derived / "generation_config.json").read_text() == \
        (tmp_path / "reference" / "generation_config.json").read_text()


def test_small_export_is_one_file(single):
    export = single / "tp1" / "llama_sharded.export"
    assert [p.name for p in export.glob("*.safetensors")] == ["model.safetensors"]
    assert not (export / "model.safetensors.index.json").exists()


@pytest.mark.slow
def test_large_export_is_sharded_with_an_index(ranks2):
    export = ranks2 / "pp2" / "llama_sharded.export"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and files == {p.name for p in export.glob("*.safetensors")}
    assert all(len(name.split("-of-")) == 2 for name in files)


# --- packed sequences ------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_match_each_document_alone(request, single, family):
    alone, packed, packed_padded = torch.load(single / "tp1" / f"{family}.packed.pt")
    diffs = _max_diff(packed, alone), _max_diff(packed_padded, alone)
    _record(request, "packed_diff", diffs[0])
    _record(request, "packed_padded_diff", diffs[1])
    assert max(diffs) < PACKED_TOL


# --- reading only what a rank needs ----------------------------------------------------------


@pytest.mark.slow
def test_each_pipeline_rank_opens_only_the_shards_it_needs(models, ranks2):
    index = json.loads((models / "llama_sharded" / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]

    def files(*prefixes: str) -> list[str]:
        return sorted({f for name, f in weight_map.items() if name.startswith(prefixes)})

    opened = [json.loads((ranks2 / "pp2" / f"llama_sharded.opened.rank{r}.json").read_text())
              for r in (0, 1)]
    assert opened[0] == files("model.embed_tokens.", "model.layers.0.")
    assert opened[1] == files("model.layers.1.", "model.norm.", "lm_head.")
    assert set(opened[0]) != set(weight_map.values())


@pytest.mark.slow
@pytest.mark.parametrize("job,expected", [
    ("pp2vp2", [[[1], [3]], [[2], [4]]]),  # interleaved: rank r holds virtual stages r, r + PP
    ("pp2uneven", [[[1]], [[2, 3, 4]]]),
])
def test_pipeline_chunks_hold_the_layers_of_their_stage(ranks2, job, expected):
    held = [json.loads((ranks2 / job / f"llama4.layers.rank{r}.json").read_text()) for r in (0, 1)]
    assert held == expected
