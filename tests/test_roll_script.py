"""ROLL's training script, run unchanged but for its import lines, trains what ``hpc-mca train``
trains (issue #58).

tests/roll_train.py is written in the shape of ROLL's ``mcore_adapter/examples/train/run_train.py``
(the same calls in the same order): ``HfArgumentParser`` over ``Seq2SeqTrainingArguments`` and
LLaMA-Factory 0.9.5's argument classes, LLaMA-Factory's tokenizer, template, ``get_dataset`` and
collators under a wrapper that pre-shifts the labels, ``AutoModel``, ``AutoConfig`` +
``AutoModel.from_config`` + ``load_state_dict`` for dpo's reference, ``apply_megatron_lora`` with
peft's ``get_peft_model`` for LoRA, ``McaTrainer`` / ``DPOTrainer(train_config=DPOConfig(...))``.
It runs through ``hpc-mca run`` with the options of ROLL's launchers, and a YAML run of
``hpc-mca train`` reads the same records (LLaMA-Factory's dataset_info.json, the same template):
every step's loss and gradient norm, and the eval loss, agree within 1e-6 (fp32), for sft, dpo
(4 pairs per micro-batch) and pt, full and LoRA, on one rank and on two (DP2, TP2; and PP2,
where the collator's micro-batches of one step differ in length and are padded to one).

Before this issue the same script either failed (13 edits) or, ported, trained silently wrong:
labels shifted twice (the wrapper's shift and the trainer's) and dpo pairs read as neighbouring
rows where LLaMA-Factory's collator puts the chosen rows first; each comparison below is the
test of one of them. The bad batches a script's collator can make end every rank with one line
and exit status 2 (tests/api_worker.py's ``bad_collator`` mode).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from trainer_fixtures import launch_ranks, make_model_dir, make_sft_data, run_ranks, steps, write_pairs

SCRIPT = Path(__file__).with_name("roll_train.py")
WORKER = Path(__file__).with_name("api_worker.py")
TOLERANCE = 1e-6
COMMON = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 4,
          "learning_rate": 1e-3, "logging_steps": 1, "eval_steps": 2, "per_device_eval_batch_size": 4,
          "seed": 7, "report_to": "none"}
"""Settings both runs get (the script as options, the YAML as keys)."""
STAGES = {
    # stage: (script options, YAML keys). sft and dpo: LLaMA-Factory's collators pad to a
    # multiple of 64, the YAML rows are 64 slots; pt: whole documents (ROLL's script packs pt
    # with LLaMA-Factory's blocks unless told --packing False; the YAML's pt_chunking document
    # cuts the same rows).
    "sft": (["--dataset", "sft", "--eval_dataset", "sft_eval", "--template", "default"],
            {"dataset": "sft", "eval_dataset": "sft_eval", "template": "default", "seq_length": 64}),
    "dpo": (["--dataset", "pairs", "--eval_dataset", "pairs_eval", "--template", "default",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"],
            {"dataset": "pairs", "eval_dataset": "pairs_eval", "template": "default", "seq_length": 64,
             "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}),
    "pt": (["--dataset", "text", "--eval_dataset", "text_eval", "--packing", "False"],
           {"dataset": "text", "eval_dataset": "text_eval", "pt_chunking": "document", "seq_length": 64}),
}
LAYOUTS = {"one": (1, [], {}), "dp2": (2, [], {}),
           "tp2": (2, ["--tensor_model_parallel_size", "2"], {"tensor_model_parallel_size": 2}),
           "pp2": (2, ["--pipeline_model_parallel_size", "2"], {"pipeline_model_parallel_size": 2})}


def _alpaca(name: str, prompt: str, response: str | None = None, **extra: object) -> dict:
    columns = {"prompt": prompt, **({"response": response} if response else {})}
    return {"file_name": f"{name}.jsonl", "columns": columns, **extra}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A tiny Llama with the demo tokenizer, and sft, pair and text records behind a
    LLaMA-Factory dataset_info.json."""
    root = tmp_path_factory.mktemp("roll_data")
    make_model_dir(root, layers=2)
    for name, count, seed in (("sft", 64, 1), ("sft_eval", 16, 2)):
        make_sft_data(root, count, seed, name)
    write_pairs(root / "pairs.jsonl", 64, 3)
    write_pairs(root / "pairs_eval.jsonl", 16, 4)
    for name in ("sft", "sft_eval"):  # pt reads the same problems as plain text
        records = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
        (root / f"{name.replace('sft', 'text')}.jsonl").write_text("".join(
            json.dumps({"text": f"{r['instruction']}{r['output']} is what we wrote down"}) + "\n" for r in records))
    pair = {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}
    info = {"sft": _alpaca("sft", "instruction", "output"), "sft_eval": _alpaca("sft_eval", "instruction", "output"),
            "pairs": {"file_name": "pairs.jsonl", "ranking": True, "columns": pair},
            "pairs_eval": {"file_name": "pairs_eval.jsonl", "ranking": True, "columns": pair},
            "text": _alpaca("text", "text"), "text_eval": _alpaca("text_eval", "text")}
    (root / "dataset_info.json").write_text(json.dumps(info))
    return root


def _script(root: Path, out: Path, stage: str, finetuning: str, layout: str) -> Path:
    nproc, options, _ = LAYOUTS[layout]
    common = [item for key, value in COMMON.items() for item in (f"--{key}", str(value))]
    argv = ["--do_train", "--stage", stage, "--finetuning_type", finetuning, "--model_name_or_path",
            str(root / "model"), "--dataset_dir", str(root), "--cutoff_len", "60", "--output_dir", str(out),
            "--eval_strategy", "steps", "--calculate_per_token_loss", "True", "--use_mca", *common,
            *STAGES[stage][0], *options]
    proc = run_ranks(nproc, ["run", str(SCRIPT), *argv], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _yaml(root: Path, out: Path, stage: str, finetuning: str, layout: str) -> Path:
    nproc, _, keys = LAYOUTS[layout]
    config = {"model_name_or_path": str(root / "model"), "dataset_dir": str(root), "stage": stage,
              "finetuning_type": finetuning, "cutoff_len": 60, "sequence_packing": False,
              "output_dir": str(out), **COMMON, **STAGES[stage][1], **keys}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    proc = run_ranks(nproc, ["train", str(path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _same_run(tmp_path: Path, root: Path, stage: str, finetuning: str, layout: str) -> None:
    script = _script(root, tmp_path / "script", stage, finetuning, layout)
    reference = _yaml(root, tmp_path / "yaml", stage, finetuning, layout)
    got, want = steps(script), steps(reference)
    assert [row["step"] for row in got] == [row["step"] for row in want] == [1, 2, 3, 4]
    for mine, ref in zip(got, want):
        assert mine.get("tokens") == ref.get("tokens"), (mine, ref)
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(ref[key], abs=TOLERANCE), (key, mine, ref)
    assert abs(got[-1]["loss"] - got[0]["loss"]) > 100 * TOLERANCE  # it trains: the comparison can tell
    progress = [json.loads((run / "progress.json").read_text()) for run in (script, reference)]
    assert progress[0]["eval_loss"] == pytest.approx(progress[1]["eval_loss"], abs=TOLERANCE)
    report = json.loads((script / "script_report.json").read_text())
    assert report["global_step"] == 4
    assert report["evaluate"]["eval_loss"] == pytest.approx(progress[1]["eval_loss"], abs=TOLERANCE)
    lora = yaml.safe_load((script / "resolved_config.yaml").read_text())["finetuning"]
    assert lora["finetuning_type"] == finetuning  # peft's LoRA read back as the run config's
    if finetuning == "lora":  # save_model: the PEFT adapter of the run config's targets
        adapter = json.loads((script / "adapter_config.json").read_text())
        assert adapter["r"] == 8 and adapter["lora_alpha"] == 16
        assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                  "up_proj", "down_proj"}
    else:
        assert (script / "model.safetensors").is_file() and (script / "config.json").is_file()


@pytest.mark.parametrize("finetuning", ["full", "lora"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_roll_script_trains_as_hpc_mca_train_on_one_rank(tmp_path, data, stage, finetuning):
    _same_run(tmp_path, data, stage, finetuning, "one")


@pytest.mark.slow
@pytest.mark.parametrize("stage, finetuning, layout", [
    ("sft", "full", "tp2"), ("sft", "lora", "dp2"), ("dpo", "full", "dp2"), ("dpo", "lora", "tp2"),
    ("pt", "full", "dp2"), ("pt", "lora", "tp2"), ("pt", "full", "pp2")])
def test_roll_script_trains_as_hpc_mca_train_on_two_ranks(tmp_path, data, stage, finetuning, layout):
    _same_run(tmp_path, data, stage, finetuning, layout)


# ---- ROLL's launchers' command lines --------------------------------------------------------

MCA_OPTIONS = ["--tensor_model_parallel_size", "2", "--sequence_parallel", "--pipeline_model_parallel_size",
               "1", "--use_distributed_optimizer", "--bias_activation_fusion", "--apply_rope_fusion",
               "--overlap_param_gather", "--overlap_grad_reduce", "--use_mca"]
"""The Megatron options ROLL's two launchers add (their USE_MCA=true branch)."""
SFT_LAUNCHER = [
    "--do_train", "--stage=sft", "--finetuning_type=full", "--dataset_dir=DATA", "--dataset=belle_2m",
    "--preprocessing_num_workers=8", "--cutoff_len=8192", "--template=qwen3", "--model_name_or_path=MODEL",
    "--output_dir=./tmp/", "--per_device_train_batch_size=1", "--gradient_accumulation_steps=4",
    "--calculate_per_token_loss=True", "--max_steps=100", "--learning_rate=2e-5", "--logging_steps=1",
    "--save_steps=50", "--lr_scheduler_type=cosine", "--bf16", *MCA_OPTIONS]
"""run_sft_train.sh's options."""
DPO_LAUNCHER = [
    "--do_train", "--stage=dpo", "--pref_loss=sigmoid", "--finetuning_type=full", "--dataset_dir=DATA",
    "--dataset=ultrafeedback", "--preprocessing_num_workers=8", "--cutoff_len=8192", "--template=llama3",
    "--model_name_or_path=MODEL", "--output_dir=./tmp/", "--per_device_train_batch_size=1",
    "--gradient_accumulation_steps=8", "--num_train_epochs=2", "--learning_rate=2e-6", "--logging_steps=1",
    "--save_steps=100", "--lr_scheduler_type=cosine", "--bf16", *MCA_OPTIONS]
"""run_dpo_train.sh's options."""


@pytest.mark.parametrize("argv", [SFT_LAUNCHER, DPO_LAUNCHER], ids=["sft", "dpo"])
def test_roll_launcher_command_lines_parse_beside_llama_factory(monkeypatch, argv):
    """``HfArgumentParser((Seq2SeqTrainingArguments, ModelArguments, DataArguments,
    FinetuningArguments, GeneratingArguments))`` parses them, and what the Megatron options say
    reaches the run config."""
    monkeypatch.setenv("DISABLE_VERSION_CHECK", "1")  # (this test's alone: forked ranks read ours)
    import lf_compat  # noqa: F401
    from llamafactory.hparams import DataArguments, FinetuningArguments, GeneratingArguments, ModelArguments
    from transformers import HfArgumentParser

    from hpc_mca.rundir import PLAN_OVERRIDES_ENV, RUN_DIR_ENV
    from hpc_mca.training_args import Seq2SeqTrainingArguments

    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.delenv(PLAN_OVERRIDES_ENV, raising=False)
    parser = HfArgumentParser((Seq2SeqTrainingArguments, ModelArguments, DataArguments,
                               FinetuningArguments, GeneratingArguments))
    training, model, data, finetuning, _ = parser.parse_args_into_dataclasses(argv)
    assert (model.model_name_or_path, data.cutoff_len, finetuning.use_mca) == ("MODEL", 8192, True)
    assert finetuning.stage == argv[1].split("=")[1] and training.do_train
    config = training.to_config()
    par = config.parallel
    assert (par.tensor_model_parallel_size, par.sequence_parallel, par.use_distributed_optimizer,
            par.overlap_grad_reduce, par.overlap_param_gather) == (2, True, True, True, True)
    assert config.model.fusions == ["swiglu", "rope"] and config.training.bf16
    assert config.training.lr_scheduler_type == "cosine" and config.training.logging_steps == 1
    assert config.training.per_device_train_batch_size == 1


# ---- a script collator's bad batches ----------------------------------------------------------


@pytest.mark.parametrize("kind, words", [
    ("labels_none", "the collator returned labels=None"),
    ("no_input_ids", "the collator returned no 'input_ids'"),
    ("float_labels", "labels has dtype torch.float32"),
    ("too_long", "rows of 80 tokens; valid: at most 64"),
    ("neither", "labels match neither input_ids"),
    ("late_bad_batch", "labels match neither input_ids"),
])
def test_a_bad_collator_batch_stops_every_rank_with_one_line(tmp_path, kind, words):
    """Under ``hpc-mca run`` on 2 ranks: each rank exits 2 and the line names the collator; a
    bad batch that one rank meets at step 3 (``late_bad_batch``) stops both ranks there."""
    out = tmp_path / "run"
    ranks = launch_ranks(2, ["run", str(WORKER), "bad_collator", str(out), kind, "max_steps=4",
                             "eval_steps=null", "sequence_packing=false", "logging_steps=1"])
    errors = [[line for line in rank.stderr.splitlines() if line.startswith("hpc-mca run: error: ")]
              for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    lines = [line for rank in errors for line in rank]
    assert lines and all("data_collator" in line for line in lines), lines
    assert any(words in line for line in lines), lines
    assert not any("Traceback" in rank.stderr for rank in ranks)
    if kind == "late_bad_batch":
        assert [row["step"] for row in steps(out)] == [1, 2]  # stopped where it met it, both ranks
