"""Stage kto against its peer: TRL's KTOTrainer on the transformers model, same weights, same
examples in the same order (TRL reads our sampler's order sequentially), same Adam, constant
LR, β, weights and gradient clipping.

Our KL rows pair each example with the answer of the one before it in the micro-step
(:mod:`hpc_mca.data.feedback`); on one rank that is TRL's rotation within its micro-batch, and
the KL estimate is TRL's micro-step mean (gradient accumulation included). TRL tokenizes the
conversational examples itself; its prompt/completion ids are checked equal to ours, and our
rows equal LLaMA-Factory's feedback samples. Step 1 and the 5-step curves agree within 1e-5
in the loss and every metric we log (TRL's names), on one Megatron rank, on the standard
backend (also with Ulysses SP2) and with two accumulated micro-batches. DP2 (two ranks of 2
examples: one micro-step of 4, as one process with 4), TP2, PP2 and CP2 equal the one-process
run within 1e-5, training and evaluation; a LoRA run's reference is its base; a checkpoint
resumes on another layout.
"""

from __future__ import annotations

import json

import pytest
from trainer_fixtures import make_model_dir, rewind, run_train, steps, write_config

STEPS, PER_STEP, LR, BETA, SEED = 5, 4, 1e-3, 0.1, 7
WEIGHTS = (1.0, 1.5)
COMPARED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "kl")


def _examples(count: int) -> list[dict]:
    """Unpaired feedback: the right sum desirable, a near miss undesirable, the tags uneven
    so that some micro-batches are lopsided."""
    from hpc_mca.data.addition import make_problems, preference_record

    records = []
    for index, (a, b) in enumerate(make_problems(count, seed=3)):
        pair = preference_record(a, b)
        good = index % 3 != 1
        records.append({"instruction": pair["instruction"],
                        "output": pair["chosen"] if good else pair["rejected"], "kto_tag": good})
    return records


def _trl_example(record: dict) -> dict:
    return {"prompt": [{"role": "user", "content": record["instruction"]}],
            "completion": [{"role": "assistant", "content": record["output"]}],
            "label": record["kto_tag"]}


def _ours(root, records, name: str, nproc: int = 1, overrides: tuple[str, ...] = ()) -> list[dict]:
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    held = root / f"{name}_eval.jsonl"  # evaluated once, after the last step
    held.write_text("".join(json.dumps(r) + "\n" for r in _examples(2 * PER_STEP)))
    (root / name).mkdir()
    config = write_config(root / name, root / "model", data, held, finetuning={
        "stage": "kto", "pref_beta": BETA, "kto_chosen_weight": WEIGHTS[0],
        "kto_rejected_weight": WEIGHTS[1]}, data={
        "cutoff_len": 32, "preprocessing_cache_dir": str(root / "cache")}, training={
        "max_steps": STEPS, "per_device_train_batch_size": PER_STEP,
        "global_batch_size": PER_STEP, "learning_rate": LR,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 1, "seed": SEED,
        "per_device_eval_batch_size": PER_STEP, "eval_steps": STEPS, "save_steps": 3})
    proc = run_train(config, root / name / "run", nproc, *overrides)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = steps(root / name / "run")
    progress = json.loads((root / name / "run" / "progress.json").read_text())
    logged[-1].update({k: v for k, v in progress.items() if k.startswith("eval_")})
    return logged


def _ordered(records: list[dict]) -> list[dict]:
    from hpc_mca.data.sampler import DataSampler

    order = DataSampler(len(records), micro_batch_size=PER_STEP, seed=SEED)
    return [records[int(i)] for i in order.global_indices(0, STEPS * PER_STEP)]


def _trl(root, records, per_device: int = PER_STEP, accumulation: int = 1,
         name: str = "trl") -> list[dict]:
    import torch
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import KTOConfig, KTOTrainer

    dataset = Dataset.from_list([_trl_example(r) for r in _ordered(records)])

    class InOrder(KTOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    torch.manual_seed(SEED)
    args = KTOConfig(output_dir=str(root / name), per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=accumulation,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", beta=BETA,
                     desirable_weight=WEIGHTS[0], undesirable_weight=WEIGHTS[1],
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=SEED,
                     max_length=None, weight_decay=0.0, max_grad_norm=1.0, adam_beta2=0.999,
                     dataloader_num_workers=0, disable_tqdm=True, bf16=False,
                     train_sampling_strategy="sequential")
    model = LlamaForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    trainer = InOrder(model=model, args=args, train_dataset=dataset,
                      processing_class=AutoTokenizer.from_pretrained(root / "model"))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "kl" in entry]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    make_model_dir(root)
    return root


@pytest.fixture(scope="module")
def records():
    return _examples(STEPS * PER_STEP + 4)


@pytest.fixture(scope="module")
def trl_run(root, records):
    return _trl(root, records)


@pytest.fixture(scope="module")
def one_process(root, records):
    return _ours(root, records, "one")


def _assert_close(ours: list[dict], theirs: list[dict], keys=COMPARED, tolerance=1e-5) -> float:
    assert len(ours) == len(theirs) == STEPS
    gap = 0.0
    for step, (mine, peer) in enumerate(zip(ours, theirs), 1):
        for key in keys:
            assert (key in mine) == (key in peer), (step, key, mine, peer)
            if key in peer:
                assert mine[key] == pytest.approx(peer[key], abs=tolerance), (step, key, mine, peer)
                gap = max(gap, abs(mine[key] - peer[key]))
    return gap


def test_kto_matches_trl_on_one_rank(one_process, trl_run):
    gap = _assert_close(one_process, trl_run)
    # The policy moves away from the reference and KL leaves 0, so the curves compare something.
    assert max(abs(s["rewards/chosen"]) for s in one_process[1:]) > 1e-2, one_process
    assert max(s["kl"] for s in one_process[1:]) > 0.0, one_process
    first = max(abs(one_process[0][k] - trl_run[0][k]) for k in COMPARED)
    print(f"kto vs TRL, one Megatron rank: step 1 largest difference {first:.2e}, "
          f"{STEPS} steps {gap:.2e}")


LAYOUTS = {"standard": (1, ("training.use_mca=false",)),
           "dp2": (2, ("training.per_device_train_batch_size=2",)),
           "tp2": (2, ("parallel.tensor_model_parallel_size=2",)),
           "pp2": (2, ("parallel.pipeline_model_parallel_size=2",)),
           "cp2": (2, ("parallel.context_parallel_size=2",)),
           "standard_sp2": (2, ("training.use_mca=false", "parallel.sequence_parallel_size=2"))}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kto_layouts_equal_one_process(root, records, one_process, trl_run, layout):
    """The standard backend against TRL; DP2 (one micro-step of 4 split over two ranks), TP2,
    PP2 and CP2 against the one-process run (and so TRL); the eval metrics of all against the
    one-process run's."""
    nproc, overrides = LAYOUTS[layout]
    if layout == "dp2":  # the same eval micro-step of 4 examples
        overrides += ("training.per_device_eval_batch_size=2",)
    ours = _ours(root, records, layout, nproc, overrides)
    evaluated = sorted(k for k in one_process[-1] if k.startswith("eval_"))
    assert {"eval_loss", "eval_kl", "eval_rewards_chosen", "eval_rewards_margins"} <= set(evaluated)
    for key in evaluated:
        assert ours[-1][key] == pytest.approx(one_process[-1][key], abs=1e-5), (key, ours[-1])
    peer = layout.startswith("standard")
    gap = _assert_close(ours, trl_run if peer else one_process)
    print(f"kto {layout}: largest difference from {'TRL' if peer else 'one process'} "
          f"over {STEPS} steps {gap:.2e}")


def test_kto_accumulation_matches_trl(root, records):
    """Two micro-batches of 2 per step: KL, pairs and metrics per micro-step, as TRL's gradient
    accumulation (its log averages the micro-steps' values)."""
    overrides = ("training.per_device_train_batch_size=2", "training.use_mca=false")
    ours = _ours(root, records, "accumulate", 1, overrides)
    theirs = _trl(root, records, per_device=2, accumulation=2, name="trl_accumulate")
    gap = _assert_close(ours, theirs)
    print(f"kto with 2 accumulated micro-batches vs TRL: largest difference {gap:.2e}")


def test_trl_tokenizes_the_examples_as_we_do(root, records):
    from types import SimpleNamespace

    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from hpc_mca.data.feedback import tokenize_feedback
    from hpc_mca.data.records import Record
    from hpc_mca.data.tokenize import load_tokenizer

    store = tokenize_feedback([Record(f"x:{i}", r) for i, r in enumerate(records)],
                              load_tokenizer(root / "model"),
                              SimpleNamespace(dataset_format="auto", template="chat", cutoff_len=64))
    assert store.stats["desirable"] == sum(r["kto_tag"] for r in records)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    args = KTOConfig(output_dir=str(root / "trl_prep"), report_to=[], use_cpu=True,
                     per_device_train_batch_size=PER_STEP)
    bare = _Bare(tokenizer)
    theirs = KTOTrainer._prepare_dataset(bare, Dataset.from_list([_trl_example(r) for r in records]),
                                         tokenizer, args, "train")
    for index, example in enumerate(theirs):
        prompt, tags = store.sample(2 * index)
        answer, _ = store.sample(2 * index + 1)
        assert list(prompt) == example["prompt_ids"] and list(answer) == example["completion_ids"]
        assert int(tags[0]) == int(example["label"])


class _Bare:
    """What KTOTrainer._prepare_dataset reads from its trainer."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.calculate_KL = True
        self.desirable_weight = self.undesirable_weight = 1.0


def test_kto_loss_by_hand():
    """Both weights, β and the KL clamp, from the formula (TRL's KTOTrainer, loss_type kto)."""
    import math
    from types import SimpleNamespace

    import torch

    from hpc_mca.loop.kto import kl_estimate, kto_loss, micro_step_metrics, micro_step_sums, step_metrics

    ft = SimpleNamespace(pref_beta=0.5, kto_chosen_weight=2.0, kto_rejected_weight=3.0)
    # answer, KL, answer, KL: policy and reference log-probabilities of two examples
    policy = torch.tensor([-4.0, -6.0, -5.0, -3.0])
    reference = torch.tensor([-5.0, -6.5, -4.0, -4.5])
    tags = torch.tensor([1, 0])
    sums = micro_step_sums(policy, reference, tags, ft.pref_beta)
    kl = kl_estimate(sums)
    assert kl == pytest.approx((0.5 + 1.5) / 2)
    losses = kto_loss(policy, reference, tags, kl, ft)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert losses.tolist() == pytest.approx([2.0 * (1 - sigmoid(0.5 * (1.0 - kl))),
                                             3.0 * (1 - sigmoid(0.5 * (kl - (-1.0))))])
    assert kl_estimate(micro_step_sums(reference, policy, tags, ft.pref_beta)) == 0.0  # clamped
    metrics = step_metrics(micro_step_metrics(sums).tolist())
    assert metrics == pytest.approx({"rewards/chosen": 0.5, "logps/chosen": -4.0,
                                     "rewards/rejected": -0.5, "logps/rejected": -5.0,
                                     "rewards/margins": 1.0, "kl": 1.0})
    # A micro-step without undesirable examples logs no rejected values (TRL logs none).
    only = step_metrics(micro_step_metrics(micro_step_sums(policy, reference, torch.tensor([1, 1]),
                                                           0.5)).tolist())
    assert set(only) == {"rewards/chosen", "logps/chosen", "kl"}


@pytest.mark.parametrize("override, message", [
    ("kto_chosen_weight=0", "finetuning.kto_chosen_weight=0.0 must be > 0 with finetuning.stage='kto'"),
    ("kto_rejected_weight=-1", "finetuning.kto_rejected_weight=-1.0 must be > 0"),
    ("pref_beta=0", "finetuning.pref_beta=0.0 must be > 0 with finetuning.stage='kto'"),
    ("sequence_packing=true", "data.sequence_packing=true with finetuning.stage='kto'"),
    ("train_on_prompt=true", "data.train_on_prompt=true with finetuning.stage='kto'"),
    ("desirable_weight=2", "use finetuning.kto_chosen_weight"),  # TRL's names
    ("undesirable_weight=2", "use finetuning.kto_rejected_weight"),
    # one example per micro-step: its KL row would be its own answer (TRL refuses it too)
    ("per_device_train_batch_size=1", "training.per_device_train_batch_size=1 on 1 data-parallel "
                                      "rank(s) with finetuning.stage='kto'"),
])
def test_bad_kto_settings_are_refused_in_one_line(tmp_path, override, message):
    from hpc_mca.config.loading import load_config
    from hpc_mca.config.sections import ConfigError
    from hpc_mca.data.addition import DEMO_DIR

    data = tmp_path / "k.jsonl"
    data.write_text(json.dumps(_examples(1)[0]) + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model_name_or_path={DEMO_DIR}", f"output_dir={tmp_path / 'o'}",
                           f"dataset={data}", "stage=kto", "per_device_train_batch_size=2",
                           override]).resolve(world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_lora_reference_is_the_base_model(root, records, one_process):
    """With LoRA the reference is the policy with its adapters off: the reference
    log-probabilities (logps − rewards/β) equal the full run's frozen copy's at every step,
    and step 1 (adapters start at zero) is the full run's step 1."""
    ours = _ours(root, records, "lora", 1, ("finetuning.finetuning_type=lora",
                                             "finetuning.lora_rank=4"))
    assert len(ours) == STEPS
    for key in COMPARED:
        assert ours[0][key] == pytest.approx(one_process[0][key], abs=1e-6), key
    gap = 0.0
    for step, (lora, full) in enumerate(zip(ours, one_process), 1):
        for side in ("chosen", "rejected"):
            mine = lora[f"logps/{side}"] - lora[f"rewards/{side}"] / BETA
            theirs = full[f"logps/{side}"] - full[f"rewards/{side}"] / BETA
            assert mine == pytest.approx(theirs, abs=1e-4), (step, side)  # /β scales 1e-5 by 10
            gap = max(gap, abs(mine - theirs))
    assert max(abs(s["rewards/chosen"]) for s in ours[1:]) > 1e-3, ours
    print(f"kto LoRA: reference log-probabilities vs the full run's frozen copy: {gap:.2e}")


@pytest.mark.slow
def test_kto_resumes_on_another_layout(root, one_process):
    """The one-process run's step-3 checkpoint resumed on DP2: steps 4-5 are the same (the
    sampler's micro-steps, hence the KL pairs, continue where they stopped)."""
    run = rewind(root / "one" / "run", root / "resumed", 3)
    proc = run_train(root / "one" / "config.yaml", run, 2, "training.per_device_train_batch_size=2",
                     "training.per_device_eval_batch_size=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at step 3" in proc.stdout, proc.stdout[-2000:]
    resumed = steps(run)
    assert [s["step"] for s in resumed] == list(range(1, STEPS + 1))
    for mine, full in zip(resumed[3:], one_process[3:]):
        for key in COMPARED:
            assert mine[key] == pytest.approx(full[key], abs=1e-5), (mine["step"], key)


def test_the_planner_sizes_kto_with_its_reference_and_kl_rows():
    """A kto example is two rows (answer and KL row) and a frozen reference scores both:
    dpo's memory (reference weights, twice the rows) and one extra forward over sft."""
    from test_topology_planner import LLAMA3_8B

    from hpc_mca.topology import Layout, Workload, estimate_memory, get_gpu
    from hpc_mca.topology.cost import estimate_step_time

    layout = Layout().resolved(8)

    def memory(stage: str, **work):
        return estimate_memory(LLAMA3_8B, layout, Workload(seq_length=4096, num_microbatches=8,
                                                           stage=stage, **work))

    sft, kto, dpo = memory("sft"), memory("kto"), memory("dpo")
    assert kto.params == dpo.params == 2 * sft.params and kto.activations == dpo.activations
    assert memory("kto", lora=True).params < kto.params  # the base is the reference
    step = {stage: estimate_step_time(LLAMA3_8B, layout, Workload(
        seq_length=4096, num_microbatches=8, stage=stage), get_gpu("H100-80GB"), 8).compute
        for stage in ("sft", "kto", "dpo")}
    assert step["kto"] == pytest.approx(step["dpo"]) and step["kto"] > 2.5 * step["sft"]


@pytest.mark.parametrize("template, cutoff", [("qwen3_nothink", 1024), ("llama3", 20)])
def test_rows_are_llamafactorys_feedback_samples(tmp_path, template, cutoff):
    """LLaMA-Factory's FeedbackDatasetProcessor on the same kto_en_demo-style entry: our
    answer rows are its input_ids/labels, and a KL row built with its pairing (the previous
    record of its batch, the first with the last) is its kl_input_ids/kl_labels, truncation by
    infer_seqlen included (cutoff 20 cuts prompts and answers)."""
    import copy

    from lf_peer import lf_converter, lf_data_args, lf_get_template_and_fix_tokenizer
    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.data.parser import get_dataset_list
    from llamafactory.data.processor.feedback import FeedbackDatasetProcessor

    from hpc_mca.data.addition import DEMO_DIR
    from hpc_mca.data.arguments import DataArguments
    from hpc_mca.data.dataset import load_samples
    from hpc_mca.data.feedback import FeedbackRows
    from hpc_mca.data.sources import resolve_sources
    from hpc_mca.data.tokenize import load_tokenizer

    entry = {"file_name": "kto.json", "formatting": "sharegpt",
             "columns": {"messages": "messages", "kto_tag": "label"},
             "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                      "assistant_tag": "assistant"}}
    records = [{"messages": [{"role": "user", "content": r["instruction"] + " please " * (k % 3)},
                             {"role": "assistant", "content": r["output"] * (1 + k % 2)}],
                "label": r["kto_tag"]} for k, r in enumerate(_examples(9))]
    (tmp_path / "kto.json").write_text(json.dumps(records))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"kto_demo": entry}))
    base = load_tokenizer(DEMO_DIR)

    tok = copy.deepcopy(base)
    lf_template = lf_get_template_and_fix_tokenizer(tok, dataset="kto_demo", template=template,
                                                    cutoff_len=cutoff)
    lf_template.mm_plugin = get_mm_plugin("base")
    args = lf_data_args(dataset="kto_demo", template=template, cutoff_len=cutoff)
    attr, = get_dataset_list(["kto_demo"], str(tmp_path))
    rows = [lf_converter.SharegptDatasetConverter(attr, args)(r) for r in records]
    batch = {key: [row[key] for row in rows] for key in rows[0]}
    theirs = FeedbackDatasetProcessor(template=lf_template, tokenizer=tok, processor=None,
                                      data_args=args).preprocess_dataset(batch)

    data = DataArguments(dataset=["kto_demo"], dataset_dir=str(tmp_path), template=template,
                         cutoff_len=cutoff, preprocessing_cache_dir=str(tmp_path / "cache"))
    source, = resolve_sources(data, "dataset", SEED)
    mine_tok = copy.deepcopy(base)
    store = load_samples(source.path, mine_tok, data, "kto", source=source)
    ours = FeedbackRows(store, cutoff, mine_tok.pad_token_id, cutoff_len=cutoff)
    assert len(ours) == len(records) and theirs["kto_tags"] == [r["label"] for r in records]
    truncated = 0
    for i in range(len(records)):
        prompt, answer, mismatched, tag = ours[(i, (i - 1) % len(records))]
        assert tag == int(theirs["kto_tags"][i])
        for row, ids, labels in ((ours._row(prompt, answer), "input_ids", "labels"),
                                 (ours._row(prompt, mismatched), "kl_input_ids", "kl_labels")):
            n = int(row["attention_mask"].sum())
            assert row["input_ids"][:n].tolist() == theirs[ids][i][:-1], (i, ids)
            assert row["labels"][:n].tolist() == theirs[labels][i][1:], (i, labels)
            truncated += len(theirs[ids][i]) == cutoff
    assert (truncated > 0) == (cutoff < 100), truncated


def test_data_line_counts_the_rows_kto_trains():
    """The data line's real/slots figure is the answer rows' real tokens over their slots (the
    count the collated rows hold), never above 1, for prompts and answers of any length."""
    import numpy as np

    from hpc_mca.data.feedback import FeedbackRows
    from hpc_mca.data.store import SampleStore

    rng = np.random.default_rng(0)
    pieces = []
    for _ in range(12):  # prompt and answer samples of each example, some longer than a row
        for length in rng.integers(1, 40, size=2):
            pieces.append((rng.integers(3, 90, size=length), np.ones(length, dtype=np.int64)))
    rows = FeedbackRows(SampleStore.from_samples(pieces), 15, 0, cutoff_len=16)
    batch = rows.collate([rows[(k, k)] for k in range(len(rows))])
    answer_rows = batch.documents[0::2]  # answer, KL, answer, KL ...; 0 = padding
    report = rows.report
    assert (report.num_samples, report.num_rows) == (12, 12)
    assert report.real_tokens == int((answer_rows > 0).sum())
    assert 0 < report.efficiency <= 1
