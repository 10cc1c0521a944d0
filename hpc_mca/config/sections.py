"""The run configuration: five dataclasses under the names LLaMA-Factory / ROLL users know.

A config is read from YAML plus ``key=value`` overrides (:func:`load_config`, in :mod:`.loading`); keys are flat
(``learning_rate``, as LLaMA-Factory YAMLs write them) or dotted (``training.learning_rate``),
and a YAML file may also nest them under the section names. Values are YAML-typed
(``bf16=true``, ``lr_scheduler_kwargs={min_lr_rate: 0.1}``, ``lr_scheduler_kwargs.min_lr=1e-5``).
Relative input paths (model, tokenizer, datasets) in a YAML file are taken relative to that
file's directory when they exist there, else relative to the working directory.
LLaMA-Factory's own names for settings (``packing``, ``flash_attn``, ``save_strategy`` ...) are
translated into these fields or refused in one line (:data:`.lf_keys.LF_KEYS`).

:meth:`TrainConfig.resolve` checks the cross-field rules for a world size, before anything is
allocated, and fills in the derived values (data-parallel size, accumulation steps, global
batch, sequence length); :meth:`TrainConfig.save_resolved` writes the result to the run dir.
Every error is a :class:`ConfigError` whose message names the dotted field, its value and the
valid choices. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from hpc_mca.data.arguments import DataArguments, DataRun
from hpc_mca.frozen import Freezable, thawed_copy
from hpc_mca.rundir import RESOLVED_CONFIG_FILE, write_atomic

from .choices import (  # re-exported: where callers look
    ATTENTION_BACKENDS,
    ATTENTION_CHOICES,
    DATASET_FORMATS,
    FINETUNING_TYPES,
    KERNEL_FUSIONS,
    OPTIMIZER_FORMATS,
    OPTIMIZERS,
    PACKED_ATTENTION,
    PACKED_KERNELS,
    PREF_LOSSES,
    REPORT_TO,
    RESERVED_FINETUNING_TYPES,
    RESHARDABLE_FORMATS,
    TRACKER_PACKAGES,
)
from .finetuning import FinetuningArguments
from .input import ConfigError
from .rules import RESOLVE_STEPS

__all__ = ["ATTENTION_BACKENDS", "ATTENTION_CHOICES", "DATASET_FORMATS", "FINETUNING_TYPES",
           "KERNEL_FUSIONS", "OPTIMIZERS", "OPTIMIZER_FORMATS", "PACKED_ATTENTION", "PACKED_KERNELS",
           "PREF_LOSSES", "REPORT_TO", "RESERVED_FINETUNING_TYPES", "RESHARDABLE_FORMATS",
           "TRACKER_PACKAGES", "ConfigError", "DataArguments", "FinetuningArguments", "ModelArguments",
           "ParallelArguments", "Derived", "TrainConfig", "TrainingArguments", "INPUT_PATHS", "SECTION_TYPES",
           "field_section", "flat_fields"]


@dataclass
class ModelArguments(Freezable):
    """Which model to build and how its attention runs."""

    model_name_or_path: str = ""
    """Local Hugging Face model directory (weights + config.json) or a config-only directory
    (config.json, random init). Nothing is downloaded."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer directory; None = ``model_name_or_path``."""
    resize_vocab: bool = False
    """Grow the embeddings (and an untied output layer) when the tokenizer, after
    ``data.template`` added its special tokens, has more tokens than the model's vocab_size, as
    LLaMA-Factory's resize_vocab: to the tokenizer's length rounded up to a multiple of 64, new
    rows the old rows' mean plus noise of std 1/sqrt(hidden), drawn from ``training.seed``
    (hpc_mca.models.vocab); the export holds the grown vocab_size and tokenizer. False: such a
    template is refused before training."""
    adapter_name_or_path: list[str] | None = None
    """PEFT adapter directories (LoRA) to load onto the model before training, in order (a
    comma-separated string works too); with several, every one but the last is merged into the
    base as LLaMA-Factory merges them, and the last trains on (``finetuning.create_new_adapter``
    false) or is merged too under a fresh adapter (true). None = start from fresh adapters."""
    attention_backend: str = "auto"
    """Core attention: auto (te, else flash, else torch), te, flash or torch."""
    packed_attention: str = "auto"
    """Packed-sequence kernel of the torch backend: auto (varlen on CUDA with bf16/fp16, else
    flex on CUDA, else sdpa), varlen (torch's varlen_attn), flex (flex_attention with a
    document block mask) or sdpa (per-document SDPA; the only one that trains on CPU)."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths: Megatron's MTP block after the decoder, on the last
    pipeline stage, depth k trained on the token k+1 places further on; 0 = none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses (their mean over depths) beside the main loss."""
    fusions: list[str] | None = None
    """Kernel fusions to turn on, each compiled by torch.compile: swiglu (Megatron's MLP gated
    activation in one kernel, recomputed in backward), cross_entropy (the vocabulary-parallel
    cross-entropy in two compiled reductions and one compiled backward pass, keeping no
    softmax: hpc_mca.models.cross_entropy), rope (RoPE's one pass over a packed stream,
    hpc_mca.models.rope) and layer (each decoder layer compiled whole, core attention left
    eager: hpc_mca.models.layer_compile).
    Empty = Megatron's unfused paths, except that packed RoPE always runs in one pass. None
    (the default) = the fastest measured for the run, chosen on each rank: [layer,
    cross_entropy] for a bf16 Megatron-backend run of a dense model on CUDA without Transformer
    Engine, else none (hpc_mca.trainer.megatron_settings.default_fusions)."""


@dataclass
class TrainingArguments(Freezable):
    """Optimisation, schedule, logging and precision, in transformers' TrainingArguments names."""

    output_dir: str = ""
    """Run directory: checkpoints, TensorBoard events, the resolved config."""
    use_mca: bool = True
    """The backend: Megatron-Core (true), or the standard backend (false): the transformers
    model under transformers' Trainer, one whole model per rank, data parallelism and Ulysses
    sequence parallelism (parallel.sequence_parallel_size), for small jobs and one-GPU
    development."""
    per_device_train_batch_size: int = 1
    """Micro-batch size: rows per forward/backward on one data-parallel rank."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step on each rank; None = 1, or derived from
    ``global_batch_size``."""
    global_batch_size: int | None = None
    """Rows per optimizer step over all ranks (Megatron style); None = micro × accumulation ×
    data-parallel size."""
    per_device_eval_batch_size: int = 8
    """Rows per evaluation micro-batch on one rank."""
    learning_rate: float = 5e-5
    """Peak learning rate."""
    lr_scheduler_type: str = "linear"
    """A name of transformers' ``get_scheduler`` (linear, cosine, cosine_with_restarts,
    polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr,
    cosine_warmup_with_min_lr, warmup_stable_decay; Megatron's inverse-square-root and WSD are
    aliases); see :mod:`hpc_mca.config.schedule`."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """That scheduler's kwargs, named and defaulted as in transformers (e.g. num_cycles,
    min_lr_rate, lr_end and power, timescale; warmup_stable_decay: num_decay_steps ...)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's steps (used when ``warmup_steps`` is 0)."""
    warmup_steps: int = 0
    """Warmup steps; overrides ``warmup_ratio`` when positive."""
    max_steps: int = -1
    """Optimizer steps of the run (> 0); -1 = ``num_train_epochs`` passes over the data. 0 and
    other negative values are refused (transformers would read them as -1)."""
    num_train_epochs: float = 3.0
    """Passes over the training rows when ``max_steps`` is -1."""
    logging_steps: int = 10
    """Log every N optimizer steps."""
    profile_steps: list[int] | None = None
    """``[first, last]``: run torch.profiler over these optimizer steps on rank 0 and write a
    trace and an operator table to output_dir/profile/ (hpc_mca.loop.profiling); None = no."""
    save_steps: int | None = None
    """Checkpoint every N steps; None = only at the end (and when a stop signal arrives)."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints in output_dir/checkpoints; None = keep all."""
    resume_from_checkpoint: str = "auto"
    """auto (continue from output_dir's latest checkpoint when there is one; YAML null), latest
    (YAML true: that checkpoint, refused when there is none), never, or a checkpoint to start
    from: its directory, a checkpoints/ directory or a run directory."""
    overwrite_output_dir: bool = False
    """Start afresh: on the first start of a run, an output_dir that already holds a run
    (checkpoints, progress) is renamed to ``<output_dir>.previous-<UTC time>`` (never deleted)
    and nothing is resumed; a requeue or resume of the same run leaves it in place."""
    save_only_model: bool = False
    """Checkpoints hold the model without the optimizer and LR-scheduler state: smaller, but
    no run can resume from them (a resume, a Slurm requeue's included, is refused)."""
    dataloader_num_workers: int = 0
    """Worker processes of the training and evaluation DataLoaders; 0 = load in the training
    process. The batches are the same for every value."""
    dataloader_prefetch_factor: int | None = None
    """Micro-batches each DataLoader worker prepares ahead (torch's ``prefetch_factor``); null:
    torch's default (2). Only with dataloader_num_workers > 0; the batches do not change."""
    plot_loss: bool = False
    """When ``hpc-mca train`` ends, rank 0 draws the run's curves (loss, eval loss, LR...) into
    output_dir/training_loss.png, as ``hpc-mca plot`` draws them."""
    ddp_timeout: int = 1800
    """Seconds a torch.distributed collective may wait before the process group gives up, on
    both backends (transformers' default; LLaMA-Factory's examples write 180000000)."""
    hang_timeout: int | None = None
    """Under a batch script: seconds without a finished optimizer step on some rank after which
    the job's watchdog names the stalled rank(s) and node(s), kills the ranks and requeues the
    job without those nodes (hpc_mca/slurm/watchdog.py). None = automatic: the larger of 300 s
    and 10 times the median step time so far, kept below ddp_timeout; 0 = no watchdog. The
    first step of each start, saves and evaluations get ddp_timeout instead (a collective in
    them waits that long anyway). Must be below ddp_timeout, whose collective timeout would
    otherwise end the job first, without naming the node; at least 5 s (the heartbeat's
    resolution) and, on a resume, 3 times the median step time already recorded; while the
    run goes, the watchdog never allows a step less than 3 times the slowest rank's median."""
    async_save: bool = False
    """Write checkpoint shards in a background process; the commit (tracker) follows at a later
    step boundary, only once every rank finished."""
    save_optimizer_format: str = "model_space"
    """Distributed-optimizer state in checkpoints: model_space (each rank writes its own slices
    as pieces of the model-space tensors: no gather, resumes on any TP/PP/DP), Megatron's
    fully_reshardable (the same tensors, gathered over DP before writing) or dp_reshardable
    (each rank's bucket shard: no gather, but a resume may change only DP). A resume reads the
    format the checkpoint was written in."""
    export_hf_dir: str | None = "."
    """After the last step, write the model as an HF safetensors directory here (relative
    paths are under output_dir; the default ``.`` is output_dir itself, where LLaMA-Factory's
    runs leave it), with the tokenizer and generation config; with LoRA, the adapter as a
    PEFT adapter directory (adapter_config.json, adapter_model.safetensors); None (YAML null)
    = no export (``hpc-mca export`` writes one from any checkpoint later)."""
    export_merged_dir: str | None = None
    """LoRA: after the last step, also write the base model with the adapters merged in as a
    full HF safetensors directory here (relative paths are under output_dir)."""
    eval_steps: int | None = None
    """Evaluate every N steps; None = only after the last step (when there is an eval set)."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Scalar sinks, several at once: tensorboard, wandb, mlflow (the last two need
    ``pip install 'hpc-mca[trackers]'``; see hpc_mca.loop.trackers), or none."""
    seed: int = 42
    """Seed of initialisation and data order."""
    bf16: bool = False
    """Train in bfloat16 (fp32 master weights)."""
    fp16: bool = False
    """Train in float16 with loss scaling."""
    optim: str = "adam"
    """adam (AdamW-style decoupled weight decay) or sgd."""
    fused_optimizer: bool = True
    """adam on torch's optimizer (no TE/Apex FusedAdam installed): run torch's fused AdamW
    kernel instead of its per-tensor loop (benchmarks/optimizer_step.py)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_epsilon: float = 1e-8
    """Adam epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""


@dataclass
class ParallelArguments(Freezable):
    """Megatron-Core parallelism, memory and communication settings."""

    tensor_model_parallel_size: int = 1
    """Tensor parallel ranks (split every matmul)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None = not interleaved."""
    pipeline_layout: list[int] | None = None
    """Transformer layers of each pipeline stage, in schedule order (PP·VP entries; with VP,
    rank r's chunks are entries r, r+PP, ...), for splits the stages do not share evenly, e.g.
    ``[15, 16, 16, 16, 16, 16, 16, 15]`` for 126 layers on PP8 (the first and last stages also
    hold the embedding and the output layer); None = an even split."""
    context_parallel_size: int = 1
    """Ranks each sequence is split over: every sequence (each packed document) is cut into
    2·CP chunks and rank r keeps chunks r and 2·CP−1−r."""
    cp_comm_type: str = "all_gather"
    """How attention sees the whole sequence under CP: all_gather (keys/values gathered over
    the CP ranks), a2a (Ulysses: all-to-all to whole sequences on heads/CP heads; CP must
    divide the key/value heads per TP rank) or p2p (ring exchange; the te backend only)."""
    expert_model_parallel_size: int = 1
    """Ranks the experts of MoE layers are spread over."""
    expert_tensor_parallel_size: int | None = None
    """Tensor parallel ranks inside an expert; None = ``tensor_model_parallel_size``."""
    data_parallel_size: int | None = None
    """Derived: world / (TP·PP·CP). Giving it only checks it."""
    sequence_parallel: bool = False
    """Split the norm and residual activations along the sequence over the TP ranks (turned
    off when TP is 1; needed by MoE models under TP; data.seq_length must then be a multiple
    of TP)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks. resolve turns it on for LoRA with
    bf16/fp16 on the Megatron backend, whose other mixed-precision optimizer cannot keep the
    float32 adapters (the resolved config in the run directory says so)."""
    overlap_grad_reduce: bool = False
    """Overlap the gradient reduce-scatter/all-reduce with backward."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather with forward (needs the distributed optimizer)."""
    recompute_granularity: str | None = None
    """Activation recomputation: None, full or selective."""
    recompute_method: str | None = None
    """With full recomputation: uniform or block."""
    recompute_num_layers: int | None = None
    """With full recomputation: layers per recomputed group (uniform) or recomputed layers per
    stage (block)."""
    recompute_modules: list[str] | None = None
    """With selective recomputation: the parts of each layer recomputed in backward
    (Megatron-Core's recompute_modules; unset: core_attn alone). core_attn: the attention
    core; layernorm: both norms, their outputs dropped after use; mlp: a dense model's MLP;
    moe: a mixture of experts' whole MoE layer (router, dispatch, experts)."""
    sequence_parallel_size: int = 1
    """Standard backend (training.use_mca=false): Ulysses sequence parallelism, consecutive
    ranks sharing each packed row (an all-to-all around attention); it must divide the
    attention and key/value heads. (Megatron-Core splits sequences with
    context_parallel_size.)"""
    calculate_per_token_loss: bool = True
    """Normalise the loss by real (non-padded) tokens over micro-batches and DP ranks."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer state on the CPU."""


@dataclass(frozen=True)
class Derived:
    """The values :meth:`TrainConfig.resolve` derives, none of them None (the section fields
    they come from are ``Optional``: unset there means "derive it")."""

    seq_length: int
    """Tokens per training row (``data.seq_length``, else ``data.cutoff_len``)."""
    data_parallel_size: int
    """Ranks that read different rows (``parallel.data_parallel_size``)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step on one rank."""
    global_batch_size: int
    """Rows per optimizer step over all data-parallel ranks."""


@dataclass
class TrainConfig(Freezable):
    """A whole run: the five argument groups."""

    model: ModelArguments = field(default_factory=ModelArguments)
    """The model."""
    data: DataArguments = field(default_factory=DataArguments)
    """The data."""
    finetuning: FinetuningArguments = field(default_factory=FinetuningArguments)
    """The stage and trainable parameters."""
    training: TrainingArguments = field(default_factory=TrainingArguments)
    """Optimisation and logging."""
    parallel: ParallelArguments = field(default_factory=ParallelArguments)
    """Megatron parallelism."""

    datasets_in_code: ClassVar[bool] = False
    """Set on a config of the Python API (:mod:`hpc_mca.api`), whose script may hand the trainer
    its datasets as objects: ``data.dataset`` is then not required, and eval settings may stand
    without eval files (``McaTrainer`` checks both against what it is given). Not a field: it is
    how the config was made, not a setting, and the resolved YAML does not hold it."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save_resolved(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write the config to ``run_dir/resolved_config.yaml`` (atomically); return the path."""
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        return write_atomic(Path(run_dir) / RESOLVED_CONFIG_FILE, self.to_yaml())

    def data_run(self) -> DataRun:
        """What the data pipeline reads besides the ``data`` section, with the values
        :meth:`resolve` derives (RuntimeError before it)."""
        tr, par, model, derived = self.training, self.parallel, self.model, self.derived
        return DataRun(stage=self.finetuning.stage, seed=tr.seed, seq_length=derived.seq_length,
                       tokenizer_path=model.tokenizer_name_or_path or model.model_name_or_path,
                       output_dir=tr.output_dir, micro_batch_size=tr.per_device_train_batch_size,
                       eval_batch_size=tr.per_device_eval_batch_size,
                       global_batch_size=derived.global_batch_size, max_steps=tr.max_steps,
                       data_parallel_size=derived.data_parallel_size,
                       context_parallel_size=par.context_parallel_size,
                       num_workers=tr.dataloader_num_workers,
                       prefetch_factor=tr.dataloader_prefetch_factor)

    @property
    def derived(self) -> Derived:
        """The derived values of this resolved config (RuntimeError before :meth:`resolve`)."""
        data, tr, par = self.data, self.training, self.parallel
        values = {"seq_length": data.seq_length, "data_parallel_size": par.data_parallel_size,
                  "gradient_accumulation_steps": tr.gradient_accumulation_steps,
                  "global_batch_size": tr.global_batch_size}
        known = {name: value for name, value in values.items() if value is not None}
        if not self.frozen or len(known) < len(values):
            raise RuntimeError(f"TrainConfig.derived before resolve() (unset: {sorted(set(values) - set(known))})")
        return Derived(**known)

    def resolve(self, world_size: int) -> TrainConfig:
        """A copy with the cross-field rules checked for ``world_size`` ranks and the derived
        fields filled in, frozen (:mod:`hpc_mca.frozen`: setting a field raises); raises
        ConfigError (one line per problem). ``self`` does not change."""
        config = thawed_copy(self)
        problems: list[str] = []
        failed: set[Any] = set()
        for check, needs in RESOLVE_STEPS:
            if failed.intersection(needs):
                continue
            try:
                check(config, world_size)
            except ConfigError as err:
                problems.append(str(err))
                failed.add(check)
        if problems:
            raise ConfigError("\n".join(problems))
        config.freeze()
        return config

    def amended(self, section: str, **changes: object) -> TrainConfig:
        """A new resolved, frozen config: this resolved one with the fields ``changes`` of
        ``section`` (``"model"``, ``"training"`` ...) set. How a rank records what it decides
        after resolution, from facts the rules do not see (the fusions its machine runs, a
        resume skipped after a fresh start, the reference model a script handed over): none of
        these feeds a derived value, so the derived fields stand. ``self`` does not change."""
        if not self.frozen:
            raise RuntimeError("TrainConfig.amended() on a config that was not resolved")
        fresh = thawed_copy(self)
        setattr(fresh, section, dataclasses.replace(getattr(fresh, section), **changes))
        fresh.freeze()
        return fresh


SECTION_TYPES: dict[str, type] = {"model": ModelArguments, "data": DataArguments,
                  "finetuning": FinetuningArguments, "training": TrainingArguments,
                  "parallel": ParallelArguments}
INPUT_PATHS = frozenset({"model.model_name_or_path", "model.tokenizer_name_or_path", "data.dataset",
                "data.eval_dataset", "data.dataset_dir", "data.data_path",
                "model.adapter_name_or_path", "finetuning.ref_model_adapters",
                "finetuning.ref_model"})
"""The dotted fields that name files or directories (read relative to a YAML file's folder)."""


def _field_index() -> dict[str, str]:
    """Flat field name -> dotted name; a flat name must be unique across sections."""
    index: dict[str, str] = {}
    for section, cls in SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise RuntimeError(f"config field {f.name} appears in two sections")
            index[f.name] = f"{section}.{f.name}"
    return index


_FLAT = _field_index()
"""Flat field name -> dotted name (read it through :func:`field_section` / :func:`flat_fields`)."""


def field_section(name: str) -> str | None:
    """The dotted name (``training.learning_rate``) of the run-config field whose flat name is
    ``name``, or None when the config has no such field."""
    return _FLAT.get(name)


def flat_fields() -> dict[str, str]:
    """Every run-config field: flat name -> dotted name (a copy)."""
    return dict(_FLAT)

