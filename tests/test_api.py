"""The Python API (``TrainingArguments``, ``AutoModel``, ``McaTrainer``) against ``hpc-mca train``.

A script (tests/api_worker.py) with its own ``torch.utils.data.Dataset`` of token dicts and its
own padding collator trains the demo's addition task to the same losses and gradient norms,
bit for bit, as ``hpc-mca train`` of the demo config on the same data and seed (rows unpacked:
the collator pads), on 1 rank, DP2 and TP2; with the default collator and packing it equals
the packed YAML run. ``TrainOutput`` and the script's callback agree with steps.jsonl. The
model ``save_model`` writes, loaded by transformers, gives ``evaluate()``'s eval loss and the
token accuracy ``compute_metrics`` computed from the trainer's predictions. dpo through the
API equals the YAML dpo run. The arguments read like the YAML (aliases, one-line errors).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_fixtures import launch_ranks, rewind, run_ranks, run_train, steps

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "hpc_mca" / "assets" / "demo"
WORKER = Path(__file__).parent / "api_worker.py"
SHORT = ["max_steps=4", "eval_steps=2", "save_steps=2", "logging_steps=1", "per_device_eval_batch_size=16",
         "report_to=none"]
UNPACKED = ["sequence_packing=false"]
LAYOUTS = {"one_rank": (1, []), "dp2": (2, []), "tp2": (2, ["tensor_model_parallel_size=2"])}


def _api_run(root: Path, name: str, nproc: int, mode: str, *overrides: str) -> Path:
    out = root / f"api_{name}"
    proc = run_ranks(nproc, [str(WORKER), mode, str(out), *overrides], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _yaml_run(root: Path, name: str, nproc: int, config: Path, *overrides: str) -> Path:
    out = root / f"yaml_{name}"
    proc = run_train(config, out, nproc, *overrides, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _numbers(run_dir: Path) -> list[tuple[float, float]]:
    return [(row["loss"], row["grad_norm"]) for row in steps(run_dir)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[str, Path]:
    """The script and the YAML run on one rank, unpacked (shared by the tests below)."""
    root = tmp_path_factory.mktemp("api")
    return {"api": _api_run(root, "one", 1, "sft", *SHORT, *UNPACKED),
            "yaml": _yaml_run(root, "one", 1, DEMO / "sft_addition.yaml", *SHORT, *UNPACKED)}


def test_script_trains_as_hpc_mca_train_on_one_rank(one_rank):
    api, yaml = _numbers(one_rank["api"]), _numbers(one_rank["yaml"])
    assert len(api) == 4 and api == yaml  # bit for bit: losses and gradient norms
    report = json.loads((one_rank["api"] / "api_report.json").read_text())
    # the script's callbacks get its own arguments object, as transformers' Trainer gives them
    assert report["args_seen"] == [["Seq2SeqTrainingArguments", True]]
    losses = [loss for loss, _ in yaml]
    assert report["global_step"] == steps(one_rank["yaml"])[-1]["step"] == 4
    assert report["training_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    # the run's wall time holds every step's own time (steps.jsonl's seconds, a second clock)
    seconds = sum(row["seconds"] for row in steps(one_rank["api"]))
    assert seconds <= report["metrics"]["train_runtime"]
    assert report["metrics"]["train_steps_per_second"] == round(4 / report["metrics"]["train_runtime"], 3)
    # the script's callback: every step end, every logged loss, the evaluations at 2 and 4
    assert report["steps"] == [1, 2, 3, 4] and report["added_steps"] == [1, 2, 3, 4]  # add_callback
    assert [log["loss"] for log in report["logs"]] == losses
    assert [e["step"] for e in report["evals"]] == [2, 4, 4, 4]  # the last two: evaluate() itself


def test_trainer_methods_a_script_calls_after_training(one_rank):
    """evaluate(metric_key_prefix=), log_metrics / save_metrics / save_state (transformers'
    files in output_dir), and predict refused in one line."""
    run = one_rank["api"]
    report = json.loads((run / "api_report.json").read_text())
    assert report["test"]["test_loss"] == report["evaluate"]["eval_loss"]
    assert set(report["test"]) == {key.replace("eval_", "test_", 1) for key in report["evaluate"]}
    assert json.loads((run / "train_results.json").read_text())["train_loss"] == report["training_loss"]
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    assert [row["loss"] for row in state["log_history"] if "loss" in row] == [s["loss"] for s in steps(run)]
    assert "McaTrainer.predict()" in report["predict"] and "valid: evaluate(" in report["predict"]
    assert "\n" not in report["predict"]


def test_evaluate_compute_metrics_and_saved_model_agree_with_transformers(one_rank):
    """Two measurements of one model: Megatron's eval loss and the greedy token accuracy
    compute_metrics got, against transformers running the model save_model wrote."""
    import api_worker
    import torch
    from transformers import AutoModelForCausalLM

    report = json.loads((one_rank["api"] / "api_report.json").read_text())
    evaluated = report["evaluate"]
    assert report["num_samples"] == 512  # every eval problem: 512 = 32 steps of 16
    assert evaluated["eval_loss"] == report["evals"][1]["eval/loss"]  # the model of step 4
    assert evaluated["eval_exact"] == evaluated["eval_accuracy"]  # compute_metrics vs the sft metric
    model = AutoModelForCausalLM.from_pretrained(one_rank["api"] / "saved").eval()
    examples = api_worker.Problems(DEMO / "eval.jsonl")
    batch = api_worker.PadTo(64)([examples[i] for i in range(len(examples))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    trained = targets != -100
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none",
                                               ignore_index=-100)
    assert float(losses[trained].mean()) == pytest.approx(evaluated["eval_loss"], rel=1e-5)
    accuracy = float((logits[:, :-1].argmax(-1) == targets)[trained].double().mean())
    assert accuracy == pytest.approx(evaluated["eval_token_accuracy"], abs=1e-9)
    assert 0.1 < accuracy < 0.9  # a model part way: the comparison can tell


def test_script_resumes_its_run_dir(tmp_path, one_rank):
    """The script started again on a run that died after its step-2 checkpoint goes on from
    there (training.resume_from_checkpoint auto, as hpc-mca train) to the uninterrupted run's
    numbers."""
    resumed = rewind(one_rank["api"], tmp_path / "api_resumed", 2)
    proc = run_ranks(1, [str(WORKER), "sft", str(resumed), *SHORT, *UNPACKED], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _numbers(resumed) == _numbers(one_rank["api"])
    report = json.loads((resumed / "api_report.json").read_text())
    assert report["steps"] == [3, 4] and report["global_step"] == 4


def test_train_resumes_from_the_checkpoint_it_is_given(tmp_path, one_rank):
    """``trainer.train(resume_from_checkpoint=PATH)`` (transformers' argument; the script's
    arguments name no checkpoint): a new run directory goes on from another run's step-2
    checkpoint to the uninterrupted run's numbers."""
    checkpoint = one_rank["api"] / "checkpoints" / "iter_0000002"
    out = tmp_path / "elsewhere"
    proc = run_ranks(1, [str(WORKER), "sft_resume_from", str(out), str(checkpoint), *SHORT, *UNPACKED],
                     timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _numbers(out) == _numbers(one_rank["api"])[2:]
    assert json.loads((out / "api_report.json").read_text())["steps"] == [3, 4]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_script_trains_as_hpc_mca_train_on_two_ranks(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    api = _api_run(tmp_path, layout, nproc, "sft", *SHORT, *UNPACKED, *extra)
    yaml = _yaml_run(tmp_path, layout, nproc, DEMO / "sft_addition.yaml", *SHORT, *UNPACKED, *extra)
    assert _numbers(api) == _numbers(yaml) and len(_numbers(api)) == 4


@pytest.mark.slow
def test_default_collator_packs_as_hpc_mca_train(tmp_path):
    api = _api_run(tmp_path, "packed", 1, "sft", *SHORT[:1], "report_to=none")
    yaml = _yaml_run(tmp_path, "packed", 1, DEMO / "sft_addition.yaml", *SHORT[:1], "report_to=none")
    assert _numbers(api) == _numbers(yaml) and len(_numbers(api)) == 4


def test_dpo_through_the_api_equals_the_yaml_run(tmp_path):
    overrides = ["max_steps=3", "eval_steps=3", "logging_steps=1", "per_device_eval_batch_size=16",
                 "report_to=none"]
    api = _api_run(tmp_path, "dpo", 1, "dpo", *overrides)
    yaml = _yaml_run(tmp_path, "dpo", 1, DEMO / "dpo_addition.yaml", *overrides)
    keys = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen")
    assert [[row[k] for k in keys] for row in steps(api)] == [[row[k] for k in keys] for row in steps(yaml)]
    report = json.loads((api / "api_report.json").read_text())
    assert report["evaluate"]["eval_rewards/accuracies"] == report["evals"][0]["eval/rewards/accuracies"]
    # the pairs in the packed rows one evaluation covers: whole steps of 16 rows (the tail left out)
    assert 200 < report["num_samples"] <= 256


def test_dpo_reference_from_automodel_equals_the_yaml_ref_model(tmp_path, one_rank):
    """ref_model=AutoModel.from_pretrained(dir) as the reference: the YAML run with
    ``ref_model: dir`` (here the sft run's saved model: weights unlike the policy's start)."""
    reference = one_rank["api"] / "saved"
    overrides = ["max_steps=2", "logging_steps=1", "eval_steps=null", "report_to=none"]
    api = _api_run(tmp_path, "dpo_ref", 1, "dpo_ref", str(reference), *overrides)
    yaml = _yaml_run(tmp_path, "dpo_ref", 1, DEMO / "dpo_addition.yaml", *overrides, f"ref_model={reference}")
    keys = ("loss", "rewards/margins", "logps/chosen")
    assert [[row[k] for k in keys] for row in steps(api)] == [[row[k] for k in keys] for row in steps(yaml)]
    assert steps(api)[0]["loss"] != pytest.approx(0.6931471805599453)  # the reference is not the policy


def test_from_config_builds_the_seeded_init_and_save_pretrained_writes_it(tmp_path):
    """AutoModel.from_config(transformers' config) and from_pretrained(its config-only
    directory) build the same seeded model; save_pretrained writes it as an HF model that
    transformers loads with those tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    built = {mode: _api_run(tmp_path, mode, 1, mode, "max_steps=1") / "init"
             for mode in ("from_config", "from_pretrained")}
    tensors = {mode: load_file(path / "model.safetensors") for mode, path in built.items()}
    assert tensors["from_config"].keys() == tensors["from_pretrained"].keys()
    assert all(tensors["from_config"][k].equal(tensors["from_pretrained"][k]) for k in tensors["from_config"])
    loaded = AutoModelForCausalLM.from_pretrained(built["from_config"]).state_dict()
    assert loaded["model.embed_tokens.weight"].equal(tensors["from_config"]["model.embed_tokens.weight"])


def test_trainer_refuses_in_one_line(tmp_path):
    out = _api_run(tmp_path, "refusals", 1, "refusals", "max_steps=2", "eval_steps=null", *UNPACKED)
    messages = json.loads((out / "api_report.json").read_text())
    expected = {"collator_with_packing": "data.sequence_packing=True with a data_collator",
                "no_data": "no train_dataset and data.dataset is empty",
                "eval_steps_without_eval": "training.eval_steps=5 without eval data",
                "other_layout": "does not divide world_size=1",
                "missing_key": "has no 'input_ids'",
                "files_beside_dataset": "the files would not be read"}
    for case, words in expected.items():
        assert messages[case] is not None and words in messages[case], (case, messages[case])
        assert "\n" not in messages[case] and "valid" in messages[case]


@pytest.mark.parametrize("override, message", [
    ("tensor_model_parallel_size=3", "tensor_model_parallel_size=3 does not divide"),  # AutoModel: the rules
    ("per_device_eval_batch_size=512", "fewer than one evaluation step"),  # McaTrainer: the eval rows
])
def test_bad_input_through_the_api_stops_every_rank_with_one_line(tmp_path, override, message):
    """Under ``hpc-mca run`` on 2 ranks: every rank exits 2, rank 0 alone prints the line,
    nothing trains."""
    out = tmp_path / "run"
    ranks = launch_ranks(2, ["run", str(WORKER), "sft", str(out), *SHORT, *UNPACKED, override])
    errors = [[line for line in rank.stderr.splitlines() if line.startswith("hpc-mca run: error: ")]
              for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    assert [len(lines) for lines in errors] == [1, 0] and message in errors[0][0]
    assert not any("Traceback" in rank.stderr for rank in ranks)
    assert not (out / "steps.jsonl").exists()


# ---- the arguments (no process group) --------------------------------------------------------


def test_arguments_are_a_view_of_the_yaml_config(monkeypatch):
    """from_config / from_yaml make the view of a run config; to_config gives that config back,
    with the view's own changes; the caller's objects are never written to."""
    from hpc_mca.config.loading import load_config
    from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.delenv(PLAN_OVERRIDES_ENV, raising=False)
    for yaml in sorted(DEMO.glob("*.yaml")):
        config = load_config(yaml, ["max_steps=3"])
        args = Seq2SeqTrainingArguments.from_config(config)
        assert args.to_config().to_dict() == config.to_dict(), yaml.name
        assert Seq2SeqTrainingArguments.from_yaml(yaml, ["max_steps=3"]).to_config().to_dict() == config.to_dict()
    config = load_config(DEMO / "sft_addition.yaml")
    before = config.to_dict()
    args = Seq2SeqTrainingArguments.from_config(config, learning_rate=1e-3, tensor_model_parallel_size=2)
    changed = args.to_config()
    assert (changed.training.learning_rate, changed.parallel.tensor_model_parallel_size) == (1e-3, 2)
    assert changed.data.dataset == config.data.dataset and config.to_dict() == before
    assert args.base_config.to_dict() == before


def test_arguments_parse_beside_the_run_config_sections(monkeypatch):
    """HfArgumentParser reads the arguments from a command line (transformers' names and
    ROLL's Megatron names), and what they say reaches the run config as the YAML keys do."""
    from transformers import HfArgumentParser

    from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.delenv(PLAN_OVERRIDES_ENV, raising=False)
    (args,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--max_steps", "3", "--tensor_model_parallel_size", "2", "--sequence_parallel",
         "--recompute_granularity", "selective", "--recompute_modules", "core_attn,mlp",
         "--optim", "adamw_torch", "--warmup_steps", "0.1", "--eval_strategy", "no", "--eval_steps", "5",
         "--bias_activation_fusion", "--distrib_optim_fully_reshardable", "--report_to", "tensorboard"])
    config = args.to_config()
    assert (config.training.max_steps, config.parallel.tensor_model_parallel_size) == (3, 2)
    assert config.parallel.sequence_parallel and config.parallel.recompute_modules == ["core_attn", "mlp"]
    assert (config.training.optim, config.training.fused_optimizer) == ("adam", False)
    assert (config.training.warmup_ratio, config.training.warmup_steps) == (0.1, 0)
    assert config.training.eval_steps is None  # eval_strategy no: transformers ignores eval_steps
    assert config.model.fusions == ["swiglu"]
    assert config.training.save_optimizer_format == "fully_reshardable"
    assert config.training.report_to == ["tensorboard"]
    # transformers' defaults where the config's differ: what transformers' and ROLL's trainers do
    assert (config.training.per_device_train_batch_size, config.training.logging_steps,
            config.training.save_steps) == (8, 500, 500)


@pytest.mark.parametrize("field, value, words", [
    ("label_smoothing_factor", 0.1, "label_smoothing_factor=0.1: sft's loss is the cross-entropy averaged"),
    ("ckpt_format", "legacy", "ckpt_format='legacy': checkpoints are Megatron's distributed"),
    ("moe_token_dispatcher_type", "allgather", "alltoall dispatcher"),
    ("overlap_p2p_comm", True, "blocking sends"),
    ("fp8", "e4m3", "no fp8 training"),
    ("save_hf_model", True, "use export_hf_dir"),
    ("check_for_nan_in_loss_and_grad", False, "always found"),
    ("transformer_impl", "transformer_engine", "local layers"),
    ("learning_rate", -1.0, None),  # the config's own rules (resolve) refuse it, not the view
])
def test_arguments_refuse_what_the_trainer_does_not_run(monkeypatch, field, value, words):
    from hpc_mca.errors import UserError
    from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.delenv(PLAN_OVERRIDES_ENV, raising=False)
    args = Seq2SeqTrainingArguments(output_dir="out", **{field: value})
    if words is None:
        args.to_config()
        return
    with pytest.raises(UserError) as err:
        args.to_config()
    assert words in str(err.value) and "\n" not in str(err.value) and "valid: " in str(err.value)


def test_every_megatron_field_of_roll_is_honoured_or_refused():
    """ROLL's 57 Megatron fields are fields here, each with its rule; none is passed over."""
    import dataclasses

    from hpc_mca.training_args import MEGATRON_FIELDS, MegatronArguments

    assert len(MEGATRON_FIELDS) == 57
    names = {f.name for f in dataclasses.fields(MegatronArguments)}
    assert set(MEGATRON_FIELDS) <= names


def test_every_training_and_parallel_setting_is_a_field_of_the_view():
    """One shape: a setting of the run config's training or parallel section is a field of the
    script arguments under its name (or NOT_IN_VIEW says why not), so a script can set it."""
    import dataclasses

    from hpc_mca.config.sections import ParallelArguments
    from hpc_mca.config.sections import TrainingArguments as TrainingSection
    from hpc_mca.training_args import NOT_IN_VIEW, Seq2SeqTrainingArguments

    view = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments) if f.init}
    settings = {f.name for cls in (TrainingSection, ParallelArguments) for f in dataclasses.fields(cls)}
    assert settings - view == set(NOT_IN_VIEW)


def test_batch_script_environment_sets_run_dir_and_planned_layout(monkeypatch, tmp_path):
    """Under hpc-mca submit: the job's run dir and the planned layout reach a script's
    arguments; a layout the script chose itself stays; another output_dir is refused."""
    from hpc_mca.errors import UserError
    from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(PLAN_OVERRIDES_ENV, "tensor_model_parallel_size=2 pipeline_model_parallel_size=2")
    config = Seq2SeqTrainingArguments(pipeline_model_parallel_size=4).to_config()
    assert config.training.output_dir == str(tmp_path)
    assert (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size) == (2, 4)
    with pytest.raises(UserError, match=f"but this job's run directory is {RUN_DIR_ENV}="):
        Seq2SeqTrainingArguments(output_dir=str(tmp_path / "elsewhere")).to_config()
