"""Reference-free preference losses (orpo, simpo, ``use_ref_model: false``) and a separate
reference checkpoint (``ref_model``), against TRL on the same weights and pairs.

The losses are LLaMA-Factory's (its YAMLs are what users run): orpo and simpo on per-token
mean log-probabilities, orpo's SFT term the chosen answer's mean token NLL of each pair. TRL's
ORPOTrainer and CPOTrainer (loss_type simpo, cpo_alpha 0) take the NLL as a token mean over a
micro-batch's chosen answers, which is the per-pair one when a micro-batch holds one pair: TRL
runs with one pair per micro-batch and 4 accumulation steps (its step loss and metrics are then
means over the 4 pairs), we with the 4 pairs in one micro-batch. TRL's own tokenizer path for
these trainers (text templating, then prompt and answer split by string) is not what is under
test: it is handed our token ids, prompt masked, in its tokenized-row format. One definition
differs: TRL's ORPOTrainer takes its NLL over prompt and answer, LLaMA-Factory over the answer
only; the peer's NLL is made the answer's (TRL's own mean log-prob of the chosen answer), its
odds-ratio term, metrics and training loop unchanged.

use_ref_model false with sigmoid is TRL's DPOTrainer with reference log-probabilities 0 (what
its former ``reference_free=True`` did; TRL 1.16 takes them precomputed); ref_model (another
Llama of the same shape, other seed) is DPOTrainer(ref_model=that model). Every step of 5 is
held to 1e-5, Megatron on one rank and the standard backend; orpo on TP2, PP2, DP2 and simpo on
DP2 equal the one-process run within 1e-5. A reference-free run holds no reference parameters
(the "dpo reference:" line counts them on rank 0).
"""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from trainer_fixtures import make_model_dir, run_train, steps, write_config

from hpc_mca.loop.preference import ORPO_METRICS, metric_names, preference_loss

STEPS, PAIRS, LR, BETA, SEED, GAMMA, CUTOFF = 5, 4, 1e-3, 0.1, 7, 0.4, 32
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected")
CASES = {  # name -> (finetuning settings, the TRL peer)
    "orpo": ({"pref_loss": "orpo"}, "orpo"),
    "simpo": ({"pref_loss": "simpo", "simpo_gamma": GAMMA}, "simpo"),
    "free": ({"pref_loss": "sigmoid", "use_ref_model": False}, "dpo_free"),
    "ref_model": ({"pref_loss": "sigmoid"}, "dpo_ref"),  # + ref_model: the other model
}


# ---- the arithmetic, against TRL's loss functions -----------------------------------------------

def _ft(**fields):
    return SimpleNamespace(**{"stage": "dpo", "pref_beta": 0.3, "pref_loss": "orpo",
                              "dpo_label_smoothing": 0.0, "pref_ftx": 0.0, "simpo_gamma": GAMMA,
                              "use_ref_model": None, **fields})


def test_reference_free_losses_equal_trl_s_formulas():
    """Summed log-probs and lengths of 3 pairs; TRL's loss methods on their per-token means."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    torch.manual_seed(0)
    lengths = torch.tensor([3.0, 5.0, 2.0, 2.0, 7.0, 1.0])
    policy = -torch.rand(6) * lengths * 3
    means = (policy / lengths).view(-1, 2)
    peer = SimpleNamespace(beta=0.3, simpo_gamma=GAMMA, label_smoothing=0.0, alpha=0.0,
                           loss_type="simpo", accelerator=SimpleNamespace(device="cpu"))
    losses, sums = preference_loss(policy, None, lengths, _ft(pref_loss="simpo"))
    want, chosen, rejected = CPOTrainer.cpo_loss(peer, means[:, 0], means[:, 1])
    assert losses.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    assert (sums[:2] / 3).tolist() == pytest.approx([float(chosen.mean()), float(rejected.mean())], abs=1e-6)
    losses, sums = preference_loss(policy, None, lengths, _ft())
    scaled, *_, log_odds_ratio, log_odds = ORPOTrainer.odds_ratio_loss(peer, means[:, 0],
                                                                      means[:, 1])
    assert losses.tolist() == pytest.approx((-means[:, 0] - scaled).tolist(), abs=1e-6)
    got = dict(zip(metric_names(_ft()), (sums / 3).tolist()))
    assert got["log_odds_ratio"] == pytest.approx(float(log_odds_ratio), abs=1e-6)
    assert got["log_odds_chosen"] == pytest.approx(float(log_odds), abs=1e-6)
    assert got["nll_loss"] == pytest.approx(float(-means[:, 0].mean()), abs=1e-6)
    # pref_ftx adds LLaMA-Factory's SFT term, the chosen answer's mean token NLL
    more, _ = preference_loss(policy, None, lengths, _ft(pref_loss="simpo", pref_ftx=0.5))
    assert (more - want).tolist() == pytest.approx((-0.5 * means[:, 0]).tolist(), abs=1e-6)
    assert metric_names(_ft(pref_loss="simpo"))[-1] == "logps/rejected"
    assert metric_names(_ft())[-3:] == ORPO_METRICS


def test_the_planner_sizes_no_reference_for_a_reference_free_run():
    from hpc_mca.stages import reference_runs
    from hpc_mca.topology import Layout
    from hpc_mca.topology.cost import _extra_forwards
    from hpc_mca.topology.memory import Workload, estimate_memory
    from hpc_mca.topology.model import ModelShape

    assert reference_runs("dpo") and not reference_runs("dpo", "orpo")
    assert not reference_runs("dpo", "sigmoid", False) and not reference_runs("sft")
    shape = ModelShape.from_hf_config({"model_type": "llama", "num_hidden_layers": 4,
                                       "hidden_size": 64, "num_attention_heads": 4,
                                       "num_key_value_heads": 4, "intermediate_size": 128,
                                       "vocab_size": 100})
    layout = Layout(tp=1, pp=1, dp=1)
    work = Workload(seq_length=64, stage="dpo", precision="fp32")
    free = Workload(seq_length=64, stage="dpo", precision="fp32", reference=False)
    with_ref, without = estimate_memory(shape, layout, work), estimate_memory(shape, layout, free)
    assert with_ref.params == 2 * without.params  # the reference's copy of every weight
    # LoRA: the frozen base is the reference, unless ref_model makes it a model of its own
    lora, own = (estimate_memory(shape, layout, Workload(
        seq_length=64, stage="dpo", precision="fp32", lora=True, separate_reference=separate))
        for separate in (False, True))
    assert own.params - lora.params == without.params  # one more copy of the base weights
    assert _extra_forwards(work) == 1 and _extra_forwards(free) == 0


@pytest.mark.parametrize("overrides, reference", [
    (["stage=dpo"], True), (["stage=dpo", "pref_loss=orpo"], False),
    (["stage=dpo", "pref_loss=simpo"], False), (["stage=dpo", "use_ref_model=false"], False)])
def test_hpc_mca_plan_asks_the_config_whether_a_reference_runs(tmp_path, overrides, reference):
    from trainer_fixtures import config_only_run

    from hpc_mca.config.loading import load_config
    from hpc_mca.slurm.jobplan import PlanOptions, _from_config

    root = config_only_run(tmp_path)
    config = load_config(root / "run.yaml", overrides).resolve(1)
    assert _from_config(config, set(), PlanOptions())["reference"] is reference
    assert _from_config(config, set(), PlanOptions())["separate_reference"] is False
    if reference:  # a ref_model of its own (the run's model dir: same shape) is sized as one
        config = load_config(root / "run.yaml", [*overrides, f"ref_model={root / 'model'}"]).resolve(1)
        assert _from_config(config, set(), PlanOptions())["separate_reference"] is True


def test_a_ref_model_of_another_shape_is_refused(tmp_path):
    from trainer_fixtures import CONFIG_ONLY_LLAMA, config_only_run

    from hpc_mca.config.loading import load_config
    from hpc_mca.config.sections import ConfigError

    run = config_only_run(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**CONFIG_ONLY_LLAMA,
                                                                "num_hidden_layers": 2}))
    with pytest.raises(ConfigError) as err:
        load_config(run / "run.yaml", ["stage=dpo", f"ref_model={tmp_path / 'other'}"]).resolve(1)
    assert str(err.value) == (
        f"finetuning.ref_model={str(tmp_path / 'other')!r} is a llama of another shape than "
        "model.model_name_or_path (llama); valid: a model of the same family, sizes and "
        "vocabulary")


# ---- runs ---------------------------------------------------------------------------------------

def _pairs(count: int) -> list[dict[str, str]]:
    from hpc_mca.data.addition import make_problems, preference_record

    return [preference_record(a, b) for a, b in make_problems(count, seed=3)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The policy's Llama, a reference Llama of the same shape (seed 1) and the pairs."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("pref_free")
    model = make_model_dir(root)
    shutil.copytree(model, root / "ref_model")
    torch.manual_seed(1)
    other = LlamaForCausalLM(LlamaForCausalLM.from_pretrained(model).config)
    other.save_pretrained(root / "ref_model")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in _pairs(STEPS * PAIRS)))
    return root


def _ours(root, case: str, layout: str = "one", nproc: int = 1, *overrides: str
          ) -> tuple[list[dict], str]:
    name = f"{case}_{layout}"
    settings, _ = CASES[case]
    if case == "ref_model":
        settings = {**settings, "ref_model": str(root / "ref_model")}
    (root / name).mkdir()
    config = write_config(root / name, root / "model", root / "pairs.jsonl", finetuning={
        "stage": "dpo", "pref_beta": BETA, **settings}, data={
        "cutoff_len": CUTOFF, "preprocessing_cache_dir": str(root / "cache")}, training={
        "max_steps": STEPS, "per_device_train_batch_size": PAIRS, "global_batch_size": PAIRS,
        "learning_rate": LR, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "logging_steps": 1, "seed": SEED})
    proc = run_train(config, root / name / "run", nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return steps(root / name / "run"), proc.stdout


def _held(stdout: str) -> tuple[int, int]:
    """(policy, reference) parameters rank 0 holds, from the "dpo reference:" line."""
    found = re.search(r"dpo reference: .*parameters held on rank 0: policy (\d+), reference (\d+)",
                      stdout)
    assert found, stdout[-2000:]
    return int(found.group(1)), int(found.group(2))


def _store(root):
    from hpc_mca.data.preference import tokenize_pairs
    from hpc_mca.data.records import Record
    from hpc_mca.data.tokenize import load_tokenizer

    store = tokenize_pairs([Record(f"x:{i}", p) for i, p in enumerate(_pairs(STEPS * PAIRS))],
                           load_tokenizer(root / "model"),
                           SimpleNamespace(dataset_format="auto", template="chat",
                                           cutoff_len=CUTOFF))
    assert store.stats["truncated"] == 0 and store.stats["dropped"] == 0
    return store


def _row(store, index: int) -> dict[str, list[int]]:
    """Pair ``index`` in TRL's tokenized-row format, from our token ids."""
    row = {}
    for side, name in ((0, "chosen"), (1, "rejected")):
        ids, labels = store.sample(2 * index + side)
        whole = [int(t) for t in ids] + [int(labels[-1])]
        prompt = len(whole) - int((labels != -100).sum())
        row[f"{name}_input_ids"] = whole
        row[f"{name}_attention_mask"] = [1] * len(whole)
        row[f"{name}_labels"] = [-100] * prompt + whole[prompt:]
        row["prompt_input_ids"], row["prompt_attention_mask"] = whole[:prompt], [1] * prompt
    return row


def _order() -> list[int]:
    from hpc_mca.data.sampler import DataSampler

    sampler = DataSampler(STEPS * PAIRS, micro_batch_size=PAIRS, seed=SEED)
    return [int(i) for i in sampler.global_indices(0, STEPS * PAIRS)]


COMMON = dict(per_device_train_batch_size=1, gradient_accumulation_steps=PAIRS, max_steps=STEPS,
              learning_rate=LR, lr_scheduler_type="constant", logging_steps=1, report_to=[],
              save_strategy="no", use_cpu=True, seed=SEED, weight_decay=0.0, max_grad_norm=1.0,
              adam_beta2=0.999, dataloader_num_workers=0, disable_tqdm=True, bf16=False)


def _trl(root, peer: str) -> list[dict]:
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    if peer.startswith("dpo"):
        return _trl_dpo(root, peer, model, tokenizer)
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    store = _store(root)
    base, args = (ORPOTrainer, ORPOConfig(output_dir=str(root / peer), beta=BETA, max_length=64,
                                          **COMMON)) if peer == "orpo" else (
        CPOTrainer, CPOConfig(output_dir=str(root / peer), beta=BETA, loss_type="simpo",
                              simpo_gamma=GAMMA, cpo_alpha=0.0, max_length=64, **COMMON))

    class OurIds(base):
        def tokenize_row(self, feature, model=None):
            return _row(store, feature["row"])

        def concatenated_forward(self, model, batch):
            """orpo: TRL's NLL term is over prompt and answer, LLaMA-Factory's over the answer
            only: the answer's mean token NLL, minus TRL's own mean log-prob of the chosen
            answer (one pair per micro-batch)."""
            out = super().concatenated_forward(model, batch)
            return (*out[:4], -out[0].mean(), *out[5:]) if peer == "orpo" else out

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    dataset = Dataset.from_list([{"prompt": "p", "chosen": "c", "rejected": "r", "row": i}
                                 for i in _order()])
    trainer = OurIds(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]


def _trl_dpo(root, peer: str, model, tokenizer) -> list[dict]:
    from datasets import Dataset
    from test_dpo_parity import _trl_example
    from torch.utils.data import SequentialSampler
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    pairs = _pairs(STEPS * PAIRS)
    dataset = Dataset.from_list([_trl_example(pairs[i]) for i in _order()])

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            """dpo_free: reference log-probabilities 0 (TRL 1.16 has no reference_free flag;
            its precomputed-reference path reads them from these columns)."""
            zeros = [0.0] * len(dataset)
            return dataset.add_column("ref_chosen_logps", zeros).add_column(
                "ref_rejected_logps", zeros)

    args = DPOConfig(output_dir=str(root / peer), beta=BETA, loss_type=["sigmoid"],
                     max_length=None, precompute_ref_log_probs=peer == "dpo_free",
                     **{**COMMON, "per_device_train_batch_size": PAIRS,
                        "gradient_accumulation_steps": 1})
    ref = (LlamaForCausalLM.from_pretrained(root / "ref_model", dtype=torch.float32)
           if peer == "dpo_ref" else None)
    trainer = InOrder(model=model, ref_model=ref, args=args, train_dataset=dataset,
                      processing_class=tokenizer)
    trainer.train()
    return [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]


def _close(ours: list[dict], theirs: list[dict], keys: tuple[str, ...], what: str) -> float:
    assert len(ours) == len(theirs) == STEPS, what
    for step, (mine, peer) in enumerate(zip(ours, theirs), 1):
        for key in keys:
            assert mine[key] == pytest.approx(peer[key], abs=1e-5), (what, step, key, mine, peer)
    return max(abs(m[k] - p[k]) for m, p in zip(ours, theirs) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_trl_on_both_backends(root, case):
    """Megatron (one rank) and the standard backend against TRL, 5 steps within 1e-5; their
    evaluations after step 5 agree within 1e-5."""
    theirs = _trl(root, CASES[case][1])
    keys = KEYS + (ORPO_METRICS if case == "orpo" else ())
    evaluate = (f"data.eval_dataset=[{root / 'pairs.jsonl'}]", "training.eval_steps=5",
                "training.per_device_eval_batch_size=2")
    megatron, stdout = _ours(root, case, "one", 1, *evaluate)
    standard, standard_out = _ours(root, case, "standard", 1, "training.use_mca=false", *evaluate)
    evals = [json.loads((root / f"{case}_{name}" / "run" / "progress.json").read_text())
             for name in ("one", "standard")]
    names = [f"eval_{key.replace('/', '_')}" for key in keys]
    assert set(names) <= set(evals[0]), evals[0]  # orpo's extra metrics evaluated too
    assert [evals[1][n] for n in names] == pytest.approx([evals[0][n] for n in names], abs=1e-5)
    gaps = [_close(megatron, theirs, keys, f"{case} megatron"),
            _close(standard, theirs, keys, f"{case} standard")]
    assert max(abs(s["rewards/margins"] - megatron[0]["rewards/margins"])
               for s in megatron) > 1e-3  # the policy moves: later steps compare something
    policy, reference = _held(stdout)
    assert reference == (policy if case == "ref_model" else 0), stdout[-2000:]
    standard_policy, standard_reference = _held(standard_out)  # HF's vocabulary: unpadded
    assert standard_reference == (standard_policy if case == "ref_model" else 0)
    print(f"{case}: largest difference from TRL over {STEPS} steps: megatron {gaps[0]:.2e}, "
          f"standard {gaps[1]:.2e}; parameters held: policy {policy}, reference {reference}")


LAYOUTS = {"tp2": "parallel.tensor_model_parallel_size=2",
           "pp2": "parallel.pipeline_model_parallel_size=2",
           "dp2": "training.per_device_train_batch_size=2"}


@pytest.mark.slow
@pytest.mark.parametrize("case, layout", [("orpo", "tp2"), ("orpo", "pp2"), ("orpo", "dp2"),
                                          ("simpo", "dp2"), ("ref_model", "pp2")])
def test_layouts_equal_one_process(root, case, layout):
    one = steps(root / f"{case}_one" / "run") if (root / f"{case}_one").exists() \
        else _ours(root, case)[0]
    got, _ = _ours(root, case, layout, 2, LAYOUTS[layout])
    keys = KEYS + (ORPO_METRICS if case == "orpo" else ())
    gap = _close(got, one, keys, f"{case} {layout}")
    print(f"{case} {layout}: largest difference from one process: {gap:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "standard"])
def test_lora_with_ref_model_scores_against_that_model(root, backend):
    """LoRA + ref_model: the reference is ref_model, not the policy with its adapters off. At
    step 1 the LoRA policy is the base (B = 0), so every logged quantity equals the full
    fine-tune's against the same ref_model; a second model is held."""
    full = root / ("ref_model_one" if backend == "megatron" else "ref_model_standard") / "run"
    want = steps(full)[0] if full.exists() else None
    extra = ["training.use_mca=false"] if backend == "standard" else []
    if want is None:
        want = _ours(root, "ref_model", f"{backend}_full", 1, *extra)[0][0]
    got, stdout = _ours(root, "ref_model", f"{backend}_lora", 1,
                        "finetuning.finetuning_type=lora", *extra)
    assert want["rewards/chosen"] != 0.0
    for key in KEYS:
        assert got[0][key] == pytest.approx(want[key], abs=1e-5), (key, got[0], want)
    policy, reference = _held(stdout)
    assert reference > 0 and reference < policy  # the base model's, without the adapters
