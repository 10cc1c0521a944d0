"""finetuning_type freeze (issue #40 point 4): LLaMA-Factory's partial fine-tuning.

The parameters that train are LLaMA-Factory's: its own ``_setup_freeze_tuning`` runs on the
transformers model as the peer, for three settings, and the trainable set (names and count)
is compared with the standard backend's and with the Megatron backend's (summed over TP / PP
ranks; vocabulary 256, so Megatron pads nothing). Frozen parameters come out of training bit
for bit (in the model and in the HF export), PP2 trains the one-process curve (its first stage
entirely frozen), a checkpoint holds only the trained layers and resumes on another layout to
the same numbers, dpo runs against a frozen copy, the planner gives gradients and optimizer
state to the trained part only, and bad settings are refused in one line.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import sys
import types
from pathlib import Path

import pytest
from trainer_fixtures import (
    config_only_run,
    make_model_dir,
    make_sft_data,
    rewind,
    run_ranks,
    run_train,
    steps,
    write_config,
    write_pairs,
)

from hpc_mca.config.loading import load_config
from hpc_mca.config.sections import ConfigError, FinetuningArguments

WORKER = Path(__file__).with_name("lora_worker.py")  # records trainable count, frozen unchanged
SETTINGS = {  # LLaMA-Factory's three kinds: last N all, first N some module, extra modules
    "last2_all": (2, ["all"], None),
    "first1_mlp": (-1, ["mlp"], None),
    "last1_attn_extra": (1, ["self_attn"], ["embed_tokens", "norm"]),
    "last3_all": (3, ["all"], None),
}
TRAIN = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "export_hf_dir": "export"}
VP2 = ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"]


def _freeze(setting: str) -> dict:
    layers, modules, extra = SETTINGS[setting]
    return {"finetuning_type": "freeze", "freeze_trainable_layers": layers,
            "freeze_trainable_modules": modules, "freeze_extra_modules": extra}


def _lf_trainable(model, setting: str) -> set[str]:
    """LLaMA-Factory's rule on ``model`` (a copy): the names of the parameters it trains.
    Its adapter module is loaded alone (its package __init__ imports trl names this trl lacks)."""
    importlib.import_module("lf_peer")  # LLaMA-Factory's torchaudio stub, before it loads
    import llamafactory

    if "llamafactory.model.adapter" not in sys.modules:
        package = types.ModuleType("llamafactory.model")
        package.__path__ = [llamafactory.__path__[0] + "/model"]
        sys.modules.setdefault("llamafactory.model", package)
    adapter = importlib.import_module("llamafactory.model.adapter")
    layers, modules, extra = SETTINGS[setting]
    args = types.SimpleNamespace(
        use_llama_pro=False, freeze_trainable_layers=layers, freeze_trainable_modules=modules,
        freeze_extra_modules=extra, freeze_multi_modal_projector=True, freeze_vision_tower=True,
        freeze_language_model=False)
    model = copy.deepcopy(model)
    adapter._setup_freeze_tuning(model, args, True, False)
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _numel(model, names: set[str]) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name in names)


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def _assert_frozen_kept(base: Path, export: Path, trained: set[str]) -> None:
    """The export's frozen tensors equal the base bit for bit; every trained one moved."""
    import torch

    before, after = _weights(base), _weights(export)
    assert before.keys() == after.keys()
    frozen = [n for n in before if n not in trained]
    assert frozen and all(torch.equal(before[n], after[n]) for n in frozen)
    assert all(not torch.equal(before[n], after[n]) for n in trained), trained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("freeze_model"), vocab_size=256)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("tied", [False, True])
def test_the_rule_trains_what_llamafactory_trains(setting, tied):
    """Standard backend's rule and the planner's count equal LLaMA-Factory's on the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_mca.models.freeze import freeze_hf_model
    from hpc_mca.topology import ModelShape
    from hpc_mca.topology.freeze import freeze_rule, hf_parameter_sizes

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    want = _lf_trainable(model, setting)
    ours = freeze_hf_model(copy.deepcopy(model),
                           FinetuningArguments(**_freeze(setting)))
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == want
    sizes = hf_parameter_sizes(ModelShape.from_hf_config(config.to_dict()))
    rule = freeze_rule(sizes, 4, *SETTINGS[setting])
    assert sum(n for name, n in sizes.items() if rule.trains(name)) == _numel(model, want)
    assert 0 < len(want) < len(list(model.parameters()))


@pytest.fixture(scope="module")
def one(model_dir, tmp_path_factory):
    """last3_all on one Megatron process, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("freeze_one")
    config = write_config(root, model_dir, make_sft_data(root, 100, 1, "train"),
                          finetuning=_freeze("last3_all"), training=TRAIN)
    proc = run_ranks(1, [WORKER, root / "out", config, f"training.output_dir={root / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root, config


def _result(out: Path) -> dict:
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_megatron_trains_llamafactorys_parameters_and_keeps_the_rest(model_dir, one):
    root, _ = one
    model = _hf_model(model_dir)
    want = _lf_trainable(model, "last3_all")
    result = _result(root / "out")
    assert result["frozen_unchanged"]
    assert result["trainable"] == _numel(model, want) == 110976
    assert result["trainable"] + result["frozen"] == sum(p.numel() for p in model.parameters())
    _assert_frozen_kept(model_dir, root / "run" / "export", want)


@pytest.mark.slow
@pytest.mark.parametrize("setting, layout", [
    ("first1_mlp", "parallel.tensor_model_parallel_size=2"),
    ("last1_attn_extra", "parallel.pipeline_model_parallel_size=2"),  # embed, norms: both stages
])
def test_megatron_trainable_count_on_two_ranks(model_dir, tmp_path, setting, layout):
    """Two more settings, counted over the TP / PP ranks, equal LLaMA-Factory's."""
    config = write_config(tmp_path, model_dir, make_sft_data(tmp_path, 40, 2, "train"),
                          finetuning=_freeze(setting), training={"max_steps": 2, "export_hf_dir": "export"})
    proc = run_ranks(2, [WORKER, tmp_path / "out", config, f"training.output_dir={tmp_path / 'run'}",
                         layout])
    assert proc.returncode == 0, proc.stderr[-4000:]
    model = _hf_model(model_dir)
    want = _lf_trainable(model, setting)
    result = _result(tmp_path / "out")
    assert result["frozen_unchanged"] and result["trainable"] == _numel(model, want)
    assert result["trainable"] == {"first1_mlp": 24576, "last1_attn_extra": 29248}[setting]
    _assert_frozen_kept(model_dir, tmp_path / "run" / "export", want)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.pipeline_model_parallel_size=2"],  # its first stage trains one layer of two
    VP2,  # rank 0: layer 0 (frozen chunk) and layer 2; rank 1: layers 1 and 3
    ["training.per_device_train_batch_size=4", "parallel.use_distributed_optimizer=true"],
])
def test_two_ranks_equal_one_process(one, tmp_path, layout):
    root, config = one
    proc = run_ranks(2, [WORKER, tmp_path / "out", config, f"training.output_dir={tmp_path / 'run'}",
                         *layout])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got, want = steps(tmp_path / "run"), steps(root / "run")
    assert [s[k] for s in got for k in ("loss", "grad_norm")] == pytest.approx(
        [s[k] for s in want for k in ("loss", "grad_norm")], abs=1e-6)
    assert _result(tmp_path / "out") == _result(root / "out")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], VP2])
def test_checkpoint_holds_the_trained_layers_and_resumes_exactly(one, tmp_path, layout):
    """On its own layout bit for bit; resharded onto PP2 × VP2 (a chunk of frozen layer 0,
    chunks that train all they hold; the gradient norm summed over two stages) within 1e-6."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    root, config = one
    checkpoint = root / "run" / "checkpoints" / "iter_0000002"
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    tensors = {k for k, v in metadata.state_dict_metadata.items()
               if not k.startswith("optimizer") and isinstance(getattr(v, "size", None), torch.Size)}
    assert tensors and {k.split(".")[2] for k in tensors} == {"1", "2", "3"}, tensors
    info = json.loads((checkpoint / "checkpoint.json").read_text())
    assert info["training"]["base_model"]["fingerprint"]
    run = rewind(root / "run", tmp_path / "resumed", 2)
    proc = run_train(config, run, 2 if layout else 1, *layout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stdout and ("pp 1->2" in proc.stdout) == bool(layout)
    got, want = steps(run), steps(root / "run")
    assert [s["step"] for s in got] == [1, 2, 3, 4]
    got, want = ([s[k] for s in found for k in ("loss", "grad_norm")] for found in (got, want))
    assert got == (pytest.approx(want, abs=1e-6) if layout else want)


@pytest.mark.slow
def test_a_resume_onto_other_base_weights_is_refused_in_one_line(model_dir, one, tmp_path):
    """The checkpoint lacks the frozen layers, which come from the base: other weights would
    silently train another model."""
    import shutil

    from safetensors.torch import save_file

    root, config = one
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    save_file({k: v + 1e-3 for k, v in _weights(model_dir).items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    run = rewind(root / "run", tmp_path / "resumed", 2)
    proc = run_train(config, run, 1, f"model.model_name_or_path={other}")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpc-mca train: error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "has other weights than the base model the freeze-trained layers of the checkpoint" in errors[0]


@pytest.mark.slow
def test_standard_backend_freezes_the_same_parameters_and_resumes_exactly(model_dir, tmp_path):
    """Its checkpoints are transformers' (the whole model; the optimizer holds the trained
    parameters only): a resume from step 2 gives the uninterrupted steps 3 and 4."""
    config = write_config(tmp_path, model_dir, make_sft_data(tmp_path, 40, 3, "train"),
                          finetuning=_freeze("last1_attn_extra"), training={**TRAIN, "use_mca": False})
    proc = run_train(config, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = _lf_trainable(_hf_model(model_dir), "last1_attn_extra")
    _assert_frozen_kept(model_dir, tmp_path / "run" / "export", want)
    run = rewind(tmp_path / "run", tmp_path / "resumed", 2)
    proc = run_train(config, run)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-4000:]
    got, uninterrupted = steps(run), steps(tmp_path / "run")
    assert [s["step"] for s in got] == [1, 2, 3, 4]
    assert [(s["loss"], s["grad_norm"]) for s in got] == [
        (s["loss"], s["grad_norm"]) for s in uninterrupted]


@pytest.mark.slow
def test_dpo_with_freeze_scores_against_a_frozen_copy(model_dir, tmp_path):
    """Step 1: the policy equals its reference copy (loss ln 2); then only the policy moves."""
    config = write_config(tmp_path, model_dir, write_pairs(tmp_path / "pairs.jsonl", 40, 4),
                          finetuning={"stage": "dpo", **_freeze("last2_all")},
                          training={"max_steps": 3, "logging_steps": 1, "learning_rate": 5e-3})
    proc = run_train(config, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [s["loss"] for s in steps(tmp_path / "run")]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[2] < losses[0] - 1e-3, losses


def test_planner_gives_optimizer_state_to_the_trained_part_only():
    from hpc_mca.topology import Layout, ModelShape, Workload, estimate_memory
    from hpc_mca.topology.freeze import (
        freeze_rule,
        freeze_sizing,
        hf_parameter_sizes,
        idle_pipeline_ranks,
        layer_ids_on_rank,
    )

    shape = ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                       ffn_hidden_size=14336, vocab_size=128256)
    rule = freeze_rule(hf_parameter_sizes(shape), 32, 2, ["all"], None)
    sizing = freeze_sizing(shape, rule)
    assert sizing.layer_shares == (0.0,) * 30 + (1.0, 1.0) and not sizing.embedding
    layout = Layout(tp=1, pp=2, dp=1)
    assert layer_ids_on_rank(shape, layout, 1) == list(range(16, 32))
    assert layer_ids_on_rank(shape, Layout(pp=2, vp=2, dp=1), 1) == [*range(8, 16), *range(24, 32)]
    assert idle_pipeline_ranks(shape, layout, sizing) == [0]
    full = estimate_memory(shape, layout, Workload(seq_length=2048))
    frozen = estimate_memory(shape, layout, Workload(seq_length=2048, freeze=sizing))
    per_layer = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
    assert frozen.params == full.params and frozen.activations == full.activations
    assert frozen.grads == 4 * 2 * per_layer  # the last stage: two trained layers, no table
    assert frozen.optimizer == 12 * 2 * per_layer < full.optimizer / 8


def test_a_freeze_config_plans_optimizer_state_for_its_trained_layers(tmp_path):
    """The job plan of a freeze config (``hpc-mca plan``/``submit``) reads the rule: the same
    job needs a fraction of the full run's gradients and optimizer state."""
    from test_submit_plan import LLAMA3_8B as LLAMA3_8B_CONFIG

    from hpc_mca.slurm.jobplan import PlanOptions, make_job_plan
    from hpc_mca.topology import format_plan_table

    model = tmp_path / "llama3-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    (tmp_path / "d.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    plans = {}
    for name, finetuning in (("full", ""), ("freeze", "finetuning:\n  finetuning_type: freeze\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"model:\n  model_name_or_path: {model}\ndata:\n  dataset: d.jsonl\n"
                        f"  cutoff_len: 4096\ntraining:\n  bf16: true\n  global_batch_size: 64\n"
                        f"{finetuning}")
        plans[name] = make_job_plan(PlanOptions(nodes=1, tp=2, pp=1), path).plan
    full, freeze = plans["full"], plans["freeze"]
    assert freeze.request.freeze is not None and full.request.freeze is None
    assert ", sft freeze bf16, seq 4096" in format_plan_table(freeze)
    assert freeze.memory.params == full.memory.params
    assert 0 < freeze.memory.optimizer < full.memory.optimizer / 6
    assert 0 < freeze.memory.grads < full.memory.grads / 6
    # Frozen layers compute no weight gradients, and fewer gradients are reduced and updated.
    assert freeze.step_time.total < full.step_time.total


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    return config_only_run(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["freeze_trainable_layers=0"], "finetuning.freeze_trainable_layers=0 with a model of 4 "
     "decoder layers; valid: 1..4 (the last N layers train) or -4..-1 (the first N)"),
    (["freeze_trainable_layers=-5"], "finetuning.freeze_trainable_layers=-5"),
    (["freeze_trainable_modules=q_proj"], "finetuning.freeze_trainable_modules=['q_proj']: q_proj "
     "is not a module of a decoder layer (whole modules only: Megatron fuses their parts); valid: "
     "all, input_layernorm, mlp, post_attention_layernorm, self_attn"),
    (["freeze_extra_modules=embed,lm_head"], "finetuning.freeze_extra_modules=['embed', "
     "'lm_head']: embed is not a module outside the decoder layers; valid: embed_tokens, "
     "lm_head, norm"),
    (["mtp_num_layers=1"], "model.mtp_num_layers=1 with finetuning.finetuning_type='freeze'"),
    (["export_merged_dir=merged"], "training.export_merged_dir='merged' merges LoRA adapters"),
    (["pipeline_model_parallel_size=2", "global_batch_size=2"],  # the default: the last 2 layers
     "finetuning.freeze_trainable_layers=2 with parallel.pipeline_model_parallel_size=2: "
     "pipeline stage(s) 0 would train nothing, which Megatron's optimizer checkpoints cannot hold"),
])
def test_bad_freeze_settings_are_refused_in_one_line(config_only, overrides, message):
    config = load_config(config_only / "run.yaml", ["finetuning_type=freeze", *overrides])
    with pytest.raises(ConfigError) as err:
        config.resolve(2 if "pipeline_model_parallel_size=2" in overrides else 1)
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)


def test_freeze_on_an_moe_model_is_refused(config_only):
    config_json = config_only / "model" / "config.json"
    shape = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({**shape, "model_type": "qwen3_moe", "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    config = load_config(config_only / "run.yaml", ["finetuning_type=freeze"])
    with pytest.raises(ConfigError, match=r"finetuning_type='freeze' with the MoE model .*valid: "
                       r"a dense model"):
        config.resolve(1)


def test_freeze_settings_given_as_strings_resolve_to_lists(config_only):
    config = load_config(config_only / "run.yaml", ["finetuning_type=freeze",
                                                     "freeze_trainable_modules=mlp,self_attn",
                                                     "freeze_extra_modules=norm"])
    config.resolve(1)
    ft = config.finetuning
    assert (ft.freeze_trainable_modules, ft.freeze_extra_modules) == (["mlp", "self_attn"], ["norm"])


def test_llamafactorys_llama_pro_is_refused_in_one_line():
    """use_llama_pro changes which layers freeze trains (every k-th): not built, so refused."""
    from hpc_mca.config.input import KNOWN_ELSEWHERE

    with pytest.raises(ConfigError) as err:
        load_config(None, ["finetuning_type=freeze", "use_llama_pro=true"])
    assert KNOWN_ELSEWHERE["use_llama_pro"] in str(err.value)
    assert len(str(err.value).splitlines()) == 1, str(err.value)
