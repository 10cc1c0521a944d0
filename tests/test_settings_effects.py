"""Run-config fields whose effect no other test showed (tests/settings_ledger.yaml).

Each test compares a run (or a data build) with the field set against one without it, and
against a reference where there is one:

* model.tokenizer_name_or_path: samples are that tokenizer's ids (a permuted copy of the demo
  vocabulary: every id, the padding included, is the permuted one).
* data.overwrite_cache: a second load reads the cache (a doctored cache file is believed)
  unless overwrite_cache is set, which tokenizes again and rewrites the file.
* finetuning.lora_alpha / lora_dropout: adapter_config.json carries them; alpha scales the
  adapters' gradient by alpha/r, dropout changes the training numbers; the PEFT adapter gives
  the trained model's logits.
* model.mtp_loss_scaling_factor: 0 trains exactly like a model without MTP, 0.5 changes the
  gradient, not the step-1 losses.
* training.resume_from_checkpoint: another run's checkpoint continues that run in a new
  directory; ``never`` trains from step 1 where a checkpoint is waiting.
* training.optim=sgd: the first update is ``lr * grad`` of the same loss computed by
  transformers' model (adam moves every element by lr); the checkpoint holds momentum, not
  Adam moments.
* parallel.recompute_*: the chosen layers (or core attention) run forward twice per
  micro-batch, and the loss and gradient-norm curve is the run without recomputation's.
* parallel.expert_tensor_parallel_size: a Qwen3-MoE on TP2 x EP2 with ETP1 (whole experts on
  each rank) equals one process.

A 2-layer Llama (the MoE test: a 2-layer Qwen3-MoE), 3 steps of 8 samples. Counting forward
calls needs a callback inside the ranks: tests/probe_worker.py is their rank program.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trainer_fixtures import (
    make_model_dir,
    make_sft_data,
    probe_run,
    rewind,
    run_ranks,
    run_train,
    same_curve,
    steps,
    write_config,
)


def _train(config: Path, run: Path, nproc: int = 1, *overrides: str):
    proc = run_train(config, run, nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The shared model, data and config; the reference run (probed, checkpoints 2 and 3)."""
    root = tmp_path_factory.mktemp("effects")
    model = make_model_dir(root, layers=2)
    config = write_config(root, model, make_sft_data(root, 64, 1, "train"),
                          training={"max_steps": 3, "logging_steps": 1, "save_steps": 2})
    probe = probe_run(config, root / "reference", 1)[0]
    return root, model, config, probe


# --- model.tokenizer_name_or_path, data.overwrite_cache (no trainer) ---------------------------


def _permuted_tokenizer(source: Path, target: Path) -> int:
    """A copy of ``source``'s one-token-per-character tokenizer with every id i renumbered
    n-1-i (specials included: <pad> becomes the last id); returns n."""
    target.mkdir()
    shutil.copy(source / "tokenizer_config.json", target)
    spec = json.loads((source / "tokenizer.json").read_text())
    n = len(spec["model"]["vocab"])
    spec["model"]["vocab"] = {tok: n - 1 - i for tok, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        added["id"] = n - 1 - added["id"]
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return n


def _datasets_of(config):
    """The rows of a resolved config (its data section and the view it gives the pipeline)."""
    from hpc_mca.data.dataset import build_datasets

    return build_datasets(config.data, config.data_run())


def _data_config(tmp_path: Path, *overrides: str):
    from hpc_mca.config.loading import load_config
    from hpc_mca.data.addition import DEMO_DIR

    return load_config(None, [
        f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'out'}",
        f"dataset=[{DEMO_DIR / 'eval.jsonl'}]", "max_samples=16", "cutoff_len=32",
        f"preprocessing_cache_dir={tmp_path / 'cache'}", "per_device_train_batch_size=1",
        "max_steps=2", *overrides]).resolve(world_size=1)


def _arrays(data) -> tuple:
    import numpy as np

    store = data.train.samples
    return (np.asarray(store.input_ids).copy(), np.asarray(store.labels).copy())


def test_tokenizer_name_or_path_encodes_the_samples(tmp_path):
    """The demo model directory with another tokenizer (same characters, ids permuted): every
    input id and label is the permuted id of the model directory's tokenizer, padding is that
    tokenizer's <pad>, and decoding with it gives the same text."""
    import numpy as np
    from transformers import AutoTokenizer

    from hpc_mca.data.addition import DEMO_DIR
    from hpc_mca.data.tokenize import IGNORE_INDEX

    n = _permuted_tokenizer(DEMO_DIR, tmp_path / "permuted")
    own = _datasets_of(_data_config(tmp_path))
    permuted = f"tokenizer_name_or_path={tmp_path / 'permuted'}"
    other = _datasets_of(_data_config(tmp_path, permuted))
    (own_ids, own_labels), (ids, labels) = _arrays(own), _arrays(other)
    assert len(ids) == len(own_ids) > 16 * 5
    assert np.array_equal(ids, n - 1 - own_ids)
    trained = own_labels != IGNORE_INDEX
    assert trained.any() and np.array_equal(labels == IGNORE_INDEX, ~trained)
    assert np.array_equal(labels[trained], n - 1 - own_labels[trained])
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "permuted")
    assert tokenizer.pad_token_id == n - 1 == other.train.pad_token_id != own.train.pad_token_id
    first = other.train.samples.sample(0)[0].tolist()
    assert tokenizer.decode(first) == own.tokenizer.decode(own.train.samples.sample(0)[0].tolist())
    row = other.train[0]["input_ids"]  # padded rows: the slots after the sample hold its <pad>
    assert row[len(first):].tolist() == [n - 1] * (len(row) - len(first))


def test_overwrite_cache_tokenizes_again(tmp_path):
    """The second load of the same file and settings is a cache hit (a doctored cache file is
    read as it is); with overwrite_cache the samples are tokenized again (cache_hits 0 in the
    'train:' line) and the cache file holds the fresh tokenization again."""
    import numpy as np

    from hpc_mca.data.store import SampleStore

    first = _datasets_of(_data_config(tmp_path))
    assert first.train.samples.stats["cache_hits"] == 0
    [cache] = list((tmp_path / "cache").glob("sft-*.npz"))
    ids, labels = _arrays(first)
    doctored = SampleStore.load(cache)
    doctored.input_ids = doctored.input_ids + 1
    doctored.save(cache)

    again = _datasets_of(_data_config(tmp_path))
    assert again.train.samples.stats["cache_hits"] == 1 and "cache_hits 1" in again.describe()
    assert np.array_equal(_arrays(again)[0], ids + 1)  # read from the cache, not tokenized

    fresh = _datasets_of(_data_config(tmp_path, "overwrite_cache=true"))
    assert fresh.train.samples.stats["cache_hits"] == 0 and "cache_hits 0" in fresh.describe()
    assert np.array_equal(_arrays(fresh)[0], ids) and np.array_equal(_arrays(fresh)[1], labels)
    assert np.array_equal(SampleStore.load(cache).input_ids, ids)  # the cache file rewritten
    assert _datasets_of(_data_config(tmp_path)).train.samples.stats["cache_hits"] == 1


def test_settings_that_need_another_one_are_refused(tmp_path):
    """recompute_method without full recomputation; lora_dropout with adapters on MoE experts
    (peft applies none there, so the export would not be the adapter trained)."""
    from transformers import Qwen3MoeConfig

    from hpc_mca.config.sections import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.recompute_method='block' needs "
                                          r"parallel.recompute_granularity='full'"):
        _data_config(tmp_path, "recompute_method=block", "recompute_num_layers=1")
    moe = tmp_path / "moe"  # a config-only model directory
    Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32).save_pretrained(moe)
    lora = ["finetuning_type=lora", "lora_dropout=0.1", f"model_name_or_path={moe}"]
    _data_config(tmp_path, *lora, "lora_target=[q_proj, o_proj]")  # no expert adapters: kept
    with pytest.raises(ConfigError, match=r"finetuning.lora_dropout=0.1 with adapters on MoE "
                                          r"experts"):
        _data_config(tmp_path, *lora, "lora_target=[q_proj, gate_up_proj]")


# --- parallel.recompute_granularity / recompute_method / recompute_num_layers ------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides, twice", [
    # Both layers in one recomputed group: every layer (and its attention) runs twice.
    ("full_uniform", ["recompute_method=uniform", "recompute_num_layers=2"], {0, 1}),
    # Only the first layer of the stage recomputed.
    ("full_block", ["recompute_method=block", "recompute_num_layers=1"], {0}),
])
def test_full_recompute_reruns_its_layers_with_the_same_curve(dense, name, overrides, twice):
    """Full recomputation: the recomputed layers (uniform: groups of recompute_num_layers;
    block: the first recompute_num_layers of the stage) run forward twice per micro-batch,
    once more in backward, the others once; the loss, grad-norm and lr curve of the run
    without recomputation within 1e-6."""
    root, _, config, reference = dense
    probe = probe_run(config, root / name, 1, "recompute_granularity=full", *overrides)[0]
    same_curve(steps(root / name), steps(root / "reference"), 1e-6, name)
    calls = reference["calls"]
    assert set(calls.values()) == {12}  # 3 steps x 4 micro-batches, forward once
    for layer in (0, 1):
        times = 2 if layer in twice else 1
        prefix = f"0.decoder.layers.{layer}"
        for key in (prefix, f"{prefix}.self_attention.core_attention"):
            assert probe["calls"][key] == times * calls[key], (name, key, probe["calls"])


@pytest.mark.slow
def test_selective_recompute_reruns_core_attention_with_the_same_curve(dense):
    """Selective recomputation (Megatron's core_attn): each layer's core attention runs
    forward twice per micro-batch, the rest of the layer once; the same curve within 1e-6."""
    root, _, config, reference = dense
    probe = probe_run(config, root / "selective", 1, "recompute_granularity=selective")[0]
    same_curve(steps(root / "selective"), steps(root / "reference"), 1e-6, "selective")
    for key, count in reference["calls"].items():
        times = 2 if key.endswith("core_attention") else 1
        assert probe["calls"][key] == times * count, (key, probe["calls"])


# --- model.mtp_loss_scaling_factor -------------------------------------------------------------


@pytest.mark.slow
def test_mtp_loss_scaling_factor_weighs_the_mtp_gradient(dense):
    """Factor 0: MTP depth 1 runs and logs its loss but adds nothing to the gradient, so the
    main loss and gradient-norm curve is the model without MTP's. Factor 0.5: the same
    step-1 losses (main and MTP, same weights), another gradient norm, and from step 3 (the
    first step after an update; warmup makes step 1's lr 0) another main loss."""
    root, _, config, _ = dense
    for factor in ("0", "0.5"):
        _train(config, root / f"mtp_{factor}", 1, "mtp_num_layers=1",
               f"mtp_loss_scaling_factor={factor}")
    plain, zero, half = (steps(root / name) for name in ("reference", "mtp_0", "mtp_0.5"))
    same_curve(zero, plain, 1e-5, "factor 0")
    assert all(s["mtp_loss_1"] > 0 for s in zero + half)
    assert half[0]["loss"] == pytest.approx(zero[0]["loss"], abs=1e-6)
    assert half[0]["mtp_loss_1"] == pytest.approx(zero[0]["mtp_loss_1"], abs=1e-6)
    assert abs(half[0]["grad_norm"] - zero[0]["grad_norm"]) > 0.1, (half[0], zero[0])
    assert abs(half[2]["loss"] - zero[2]["loss"]) > 1e-3, (half[2], zero[2])


# --- training.resume_from_checkpoint -----------------------------------------------------------


@pytest.mark.slow
def test_resume_from_another_runs_checkpoint_continues_it(dense):
    """A new output_dir started from the reference's step-2 checkpoint: it says so, trains only
    step 3, and step 3 is the reference's; the reference's directory is left as it was."""
    root, _, config, _ = dense
    source = root / "reference" / "checkpoints" / "iter_0000002"
    before = sorted(p.name for p in (root / "reference" / "checkpoints").iterdir())
    proc = _train(config, root / "continued", 1, f"resume_from_checkpoint={source}")
    assert f"resumed from {source} at step 2 (16 samples)" in proc.stdout, proc.stdout[-2000:]
    same_curve(steps(root / "continued"), steps(root / "reference")[2:], 1e-6, "continued")
    saved = sorted(p.name for p in (root / "continued" / "checkpoints").glob("iter_*"))
    assert saved == ["iter_0000003"]
    assert sorted(p.name for p in (root / "reference" / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_resume_never_trains_from_step_one_beside_a_checkpoint(dense):
    """The reference as if it had died after its step-2 checkpoint (auto would train step 3
    only): with resume_from_checkpoint=never it trains steps 1-3 afresh, the reference's."""
    root, _, config, _ = dense
    run = rewind(root / "reference", root / "never", 2)
    proc = _train(config, run, 1, "resume_from_checkpoint=never")
    assert "resumed from" not in proc.stdout, proc.stdout[-2000:]
    progress = [line.split(" |")[0] for line in proc.stdout.splitlines()
                if line.startswith("step ")]
    assert progress == ["step 1/3", "step 2/3", "step 3/3"], proc.stdout[-2000:]
    same_curve(steps(run), steps(root / "reference"), 1e-6, "never")


# --- training.optim ----------------------------------------------------------------------------


def _first_step_gradient(config: Path, model_dir: Path) -> dict:
    """The gradient of step 1's loss (mean over the global batch's trained tokens), taken by
    transformers' model on the micro-batches the run's loader gives step 1."""
    import itertools

    import torch
    from transformers import AutoModelForCausalLM

    from hpc_mca.config.loading import load_config
    from hpc_mca.data.dataset import build_datasets, train_dataloader

    resolved = load_config(config).resolve(world_size=1)
    run = resolved.data_run()
    loader = train_dataloader(build_datasets(resolved.data, run).train, run, data_parallel_rank=0)
    micro = list(itertools.islice(loader, resolved.training.gradient_accumulation_steps))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = sum(int((b.labels != -100).sum()) for b in micro)
    loss = sum(torch.nn.functional.cross_entropy(
        model(input_ids=b.input_ids, position_ids=b.position_ids).logits.flatten(0, 1),
        b.labels.flatten(), ignore_index=-100, reduction="sum") for b in micro) / tokens
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_sgd_takes_the_plain_gradient_step(dense):
    """One step at lr 1 (constant, no clipping), weights exported: sgd moved every weight by
    exactly minus transformers' gradient of the same loss (within 1e-3 of each tensor's
    largest gradient); adam, the default, moved every element with a gradient by lr. The
    checkpoints record the optimizer and hold its state: momentum, or Adam's two moments."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    root, model, config, _ = dense
    one_step = ["learning_rate=1.0", "lr_scheduler_type=constant", "warmup_steps=0",
                "max_grad_norm=0", "max_steps=1", "export_hf_dir=hf"]
    for optim in ("sgd", "adam"):
        _train(config, root / optim, 1, f"optim={optim}", *one_step)
    grads = _first_step_gradient(config, model)
    start = load_file(model / "model.safetensors")
    moved = {optim: load_file(root / optim / "hf" / "model.safetensors")
             for optim in ("sgd", "adam")}
    for name, grad in grads.items():
        sgd = start[name] - moved["sgd"][name]
        assert (sgd - grad).abs().max() <= 1e-3 * grad.abs().max(), name
        adam = (start[name] - moved["adam"][name])[grad.abs() > 1e-6]
        assert adam.numel() and (adam.abs() - 1.0).abs().max() < 0.01, name
    assert steps(root / "sgd")[0]["loss"] == steps(root / "adam")[0]["loss"]
    for optim, state in (("sgd", {"momentum_buffer"}), ("adam", {"exp_avg", "exp_avg_sq"})):
        checkpoint = root / optim / "checkpoints" / "iter_0000001"
        info = json.loads((checkpoint / "checkpoint.json").read_text())
        assert info["training"]["optim"] == optim
        keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        assert {k.split(".")[2] for k in keys if k.startswith("optimizer.state.")} == state


# --- finetuning.lora_alpha / lora_dropout ------------------------------------------------------


@pytest.fixture(scope="module")
def lora(dense):
    """LoRA rank 4 on every linear (tests/lora_worker.py: logits of the trained model):
    alpha default (2 x rank), alpha 16, dropout 0.1; each exported as a PEFT adapter."""
    from test_lora import WORKER

    root, _, config, _ = dense
    runs = {"lora": [], "lora_alpha16": ["lora_alpha=16"], "lora_dropout": ["lora_dropout=0.1"]}
    for name, extra in runs.items():
        proc = run_ranks(1, [WORKER, root / f"{name}_out", config,
                             f"training.output_dir={root / name}", "finetuning_type=lora",
                             "lora_rank=4", "learning_rate=5e-3", "export_hf_dir=adapter", *extra])
        assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def _adapter(run: Path) -> dict:
    return json.loads((run / "adapter" / "adapter_config.json").read_text())


def _logits_gap(root: Path, name: str) -> tuple[float, float]:
    """(max |PEFT adapter's logits - the trained model's|, max |base model's - trained|)."""
    from test_lora import _hf_logits, _ours, _peft_logits

    vocab = json.loads((root / "model" / "config.json").read_text())["vocab_size"]
    ours = _ours(root / f"{name}_out", vocab)
    return (float((_peft_logits(root / "model", root / name / "adapter") - ours).abs().max()),
            float((_hf_logits(root / "model") - ours).abs().max()))


@pytest.mark.slow
def test_lora_alpha_scales_the_adapters(lora):
    """alpha 16 on rank 4 (scaling 4, the default 8 scales by 2): adapter_config.json says 16;
    the adapters start at zero, so step 1 has the same loss and a gradient norm exactly
    twice the default's (only B's gradient, which the scaling multiplies); PEFT loading the
    export gives the trained model's logits."""
    root = lora
    default_config, alpha16_config = _adapter(root / "lora"), _adapter(root / "lora_alpha16")
    assert (default_config["r"], default_config["lora_alpha"]) == (4, 8)
    assert (alpha16_config["r"], alpha16_config["lora_alpha"]) == (4, 16)
    default, alpha16 = steps(root / "lora"), steps(root / "lora_alpha16")
    assert alpha16[0]["loss"] == default[0]["loss"]
    assert alpha16[0]["grad_norm"] == pytest.approx(2 * default[0]["grad_norm"], rel=1e-6)
    assert abs(alpha16[2]["loss"] - default[2]["loss"]) > 1e-3
    peft_gap, trained = _logits_gap(root, "lora_alpha16")
    assert peft_gap < 1e-5 and trained > 0.1, (peft_gap, trained)


@pytest.mark.slow
def test_lora_dropout_changes_training_not_the_export(lora):
    """Dropout 0.1 on the adapters' input: adapter_config.json says 0.1; with the same seed,
    step 1 has the same loss (the adapters start at zero) but another gradient, and step 3
    another loss; evaluation has no dropout, so PEFT loading the export gives the trained
    model's logits."""
    root = lora
    assert _adapter(root / "lora")["lora_dropout"] == 0.0
    assert _adapter(root / "lora_dropout")["lora_dropout"] == 0.1
    plain, dropped = steps(root / "lora"), steps(root / "lora_dropout")
    assert dropped[0]["loss"] == plain[0]["loss"]
    assert abs(dropped[0]["grad_norm"] - plain[0]["grad_norm"]) > 1e-4, (dropped[0], plain[0])
    assert abs(dropped[2]["loss"] - plain[2]["loss"]) > 1e-5, (dropped[2], plain[2])
    peft_gap, trained = _logits_gap(root, "lora_dropout")
    assert peft_gap < 1e-5 and trained > 0.1, (peft_gap, trained)


# --- parallel.expert_tensor_parallel_size ------------------------------------------------------


@pytest.mark.slow
def test_expert_tensor_parallel_one_keeps_experts_whole_under_tp2(tmp_path):
    """Qwen3-MoE (4 experts of ffn 32, hidden 64) on TP2 x EP2 with expert_tensor_parallel_size
    1 (MoE with TP needs sequence parallelism): each rank holds 2 whole experts per layer
    (fc1 [64, 64], where ETP2 would give [32, 64]), checkpoint.json records etp 1, and 3 steps
    equal one process within 1e-5. Without the field (ETP = TP = 2) the layout is refused."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.config.sections import ConfigError

    model = make_model_dir(tmp_path, layers=2, moe=True)
    config = write_config(tmp_path, model, make_sft_data(tmp_path, 64, 1, "train"),
                          training={"max_steps": 3, "logging_steps": 1})
    layout = ["tensor_model_parallel_size=2", "expert_model_parallel_size=2",
              "sequence_parallel=true"]
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size=2"):
        load_config(config, layout).resolve(world_size=2)
    _train(config, tmp_path / "one", 1)
    ranks = probe_run(config, tmp_path / "etp1", 2, *layout, "expert_tensor_parallel_size=1")
    same_curve(steps(tmp_path / "etp1"), steps(tmp_path / "one"), 1e-5, "tp2 ep2 etp1")
    for rank in ranks:
        shapes = rank["expert_shapes"]
        for layer in (0, 1):
            fc1 = [shape for name, shape in shapes.items()
                   if name.startswith(f"0.decoder.layers.{layer}.")
                   and name.endswith("linear_fc1.weight")]
            assert fc1 == [[64, 64], [64, 64]], shapes
    saved = tmp_path / "etp1" / "checkpoints" / "iter_0000003" / "checkpoint.json"
    layout_saved = json.loads(saved.read_text())["layout"]
    assert {k: layout_saved[k] for k in ("tp", "ep", "etp", "dp")} == \
        {"tp": 2, "ep": 2, "etp": 1, "dp": 1}


# --- training.fp16, parallel.overlap_param_gather ----------------------------------------------


@pytest.mark.slow
def test_fp16_trains_under_a_dynamic_loss_scale(dense):
    """fp16 parameters, fp32 master weights: steps whose scaled gradients overflow are skipped
    and halve the loss scale (counted), the rest train like fp32 (issue #37: the loss was never
    scaled, so the optimizer unscaled gradients by 2^32 and the weights barely moved)."""
    root, _, config, _ = dense
    overrides = ("training.max_steps=12", "training.save_steps=12")
    _train(config, root / "fp32", 1, *overrides)
    _train(config, root / "fp16", 1, "training.fp16=true", *overrides)
    ref, half = steps(root / "fp32"), steps(root / "fp16")
    assert half[0]["loss"] == pytest.approx(ref[0]["loss"], abs=5e-3)
    trained = [s for s in half if not s["skipped"]]
    assert 0 < len(half) - len(trained) <= 6, half  # the scale settles from 2^16
    assert half[-1]["loss"] < half[0]["loss"] - 0.05, half
    info = json.loads((root / "fp16" / "checkpoints" / "iter_0000012" / "checkpoint.json")
                      .read_text())
    assert info["training"]["precision"] == "fp16"


@pytest.mark.slow
def test_overlap_param_gather_saves_and_exports_this_steps_weights(dense):
    """DP2 with the distributed optimizer: overlapping the parameter all-gather with the next
    forward trains the same curve, and its checkpoints and export hold the weights of the step
    they name (issue #37: the half of the buffer the other rank updates was a step old, and a
    resume from it was not exact)."""
    import torch
    from safetensors.torch import load_file

    root, _, config, _ = dense
    common = ("parallel.use_distributed_optimizer=true", "training.export_hf_dir=hf")
    _train(config, root / "dist_opt", 2, *common)
    _train(config, root / "overlap", 2, *common, "parallel.overlap_param_gather=true",
           "parallel.overlap_grad_reduce=true")
    same_curve(steps(root / "overlap"), steps(root / "dist_opt"), 1e-6, "overlap")
    plain = load_file(root / "dist_opt" / "hf" / "model.safetensors")
    overlapped = load_file(root / "overlap" / "hf" / "model.safetensors")
    assert max((overlapped[k] - plain[k]).abs().max().item() for k in plain) < 1e-6
    resumed = rewind(root / "overlap", root / "overlap_resumed", 2)
    shutil.rmtree(resumed / "hf")
    _train(config, resumed, 2, *common, "parallel.overlap_param_gather=true",
           "parallel.overlap_grad_reduce=true")
    same_curve(steps(resumed), steps(root / "overlap"), 1e-6, "overlap resumed")  # 1-2 kept
    assert torch.equal(load_file(resumed / "hf" / "model.safetensors")["lm_head.weight"],
                       overlapped["lm_head.weight"])
