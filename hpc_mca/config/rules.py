"""The cross-field rules :meth:`TrainConfig.resolve` checks for a world size, and the values it
derives (data-parallel size, accumulation steps, global batch, sequence length).

Each check raises :class:`ConfigError` with one line per problem, naming the dotted field, its
value and the valid choices. Parallel-layout rules are the topology planner's
(``check_layout``), with its Megatron names rewritten to this config's dotted names; what
trains and each stage's loss settings are :mod:`.finetuning_rules`' (one step here).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_mca.data.arguments import DataArguments
from hpc_mca.data.choices import MIX_STRATEGIES, PT_CHUNKINGS
from hpc_mca.data.records import FORMATS_BY_READS
from hpc_mca.data.templates import TEMPLATE_NAMES
from hpc_mca.stages import (
    RESERVED_STAGES,
    STAGE_NAMES,
    TEXT,
    get_stage,
    stages_where,
)
from hpc_mca.topology import Layout, check_layout
from hpc_mca.topology.choices import CP_COMM_TYPES, recompute_parts

from .checks import at_least as _at_least
from .checks import choice as _choice
from .choices import (
    ATTENTION_CHOICES,
    DATASET_FORMATS,
    FINETUNING_TYPES,
    KERNEL_FUSIONS,
    OPTIMIZER_FORMATS,
    OPTIMIZERS,
    PACKED_ATTENTION,
    REPORT_TO,
    RESERVED_FINETUNING_TYPES,
    TRACKER_PACKAGES,
)
from .finetuning_rules import check_finetuning as _check_finetuning
from .finetuning_rules import check_micro_step
from .input import ConfigError
from .layout import layout_of, model_shape, model_type, our_names
from .run_settings import check_run_settings
from .schedule import SchedulerError, resolve_warmup_steps, scheduler_spec
from .scope import check_scopes

if TYPE_CHECKING:  # the sections import the rules: a runtime import here would be a circle
    from .sections import ParallelArguments, TrainConfig, TrainingArguments

# --- resolve: cross-field rules ------------------------------------------------------------


def _check_model(config: TrainConfig, world_size: int) -> None:
    model = config.model
    _choice("model.attention_backend", model.attention_backend, ATTENTION_CHOICES)
    _choice("model.packed_attention", model.packed_attention, PACKED_ATTENTION)
    for fusion in model.fusions or ():  # None: chosen on the rank (default_fusions)
        if fusion not in KERNEL_FUSIONS:
            raise ConfigError(f"model.fusions: {fusion!r} is not a fusion; valid: "
                              + ", ".join(KERNEL_FUSIONS))
    if not model.model_name_or_path:
        raise ConfigError("model.model_name_or_path is required (a local HF model or "
                          "config directory)")
    if not (Path(model.model_name_or_path) / "config.json").is_file():
        raise ConfigError(f"model.model_name_or_path={model.model_name_or_path!r} has no "
                          "config.json (models are never downloaded)")
    if "auto_map" in _hf_config(model.model_name_or_path):
        # Whatever trust_remote_code says: models are built from config.json by this project's
        # code, so a model whose architecture lives in the directory's own Python would be
        # built as something else (or not at all).
        raise ConfigError(f"model.model_name_or_path={model.model_name_or_path!r}: its "
                          "config.json's auto_map asks for the model's own Python code, which "
                          "never runs here (trust_remote_code has no effect); valid: a model "
                          "of a family transformers itself defines, without auto_map")
    if model.resize_vocab and config.finetuning.finetuning_type == "lora":
        # The LoRA export is the adapter alone: the grown rows would not reach it.
        raise ConfigError("model.resize_vocab=true with finetuning.finetuning_type='lora': the "
                          "adapter export would not hold the grown embedding rows; valid: "
                          "finetuning_type full or freeze")
    _check_mtp(config)


def _hf_config(model_dir: str) -> dict[str, Any]:
    try:
        found = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # model_shape reports a broken config.json in its own words
    return found if isinstance(found, dict) else {}


def _check_mtp(config: TrainConfig) -> None:
    """MTP layers load from the checkpoint's MTP modules where it holds them (DeepSeek-V3 and
    GLM-4.5 checkpoints: models.mtp), else start from a fresh init (models.mtp.initialise) on
    top of the model's weights; a family without MTP modules exports the model without them
    (its logits are the trained model's: MTP heads only add training losses) and says so; the
    checkpoints keep them."""
    model, depths = config.model, config.model.mtp_num_layers
    _at_least("model.mtp_num_layers", depths, 0)
    _at_least("model.mtp_loss_scaling_factor", model.mtp_loss_scaling_factor, 0)


def _check_stage(config: TrainConfig, world_size: int) -> None:
    """The stage and fine-tuning type, which the data and finetuning rules depend on."""
    ft = config.finetuning
    if ft.stage in RESERVED_STAGES:
        raise ConfigError(f"finetuning.stage={ft.stage!r} is not yet supported; valid: "
                          + ", ".join(STAGE_NAMES))
    _choice("finetuning.stage", ft.stage, STAGE_NAMES)
    if ft.finetuning_type in RESERVED_FINETUNING_TYPES:
        raise ConfigError(f"finetuning.finetuning_type={ft.finetuning_type!r} is not yet "
                          f"supported; valid: {', '.join(FINETUNING_TYPES)}")
    _choice("finetuning.finetuning_type", ft.finetuning_type, FINETUNING_TYPES)


def _check_blend(config: TrainConfig, data_path: list[str]) -> None:
    """data.data_path (Megatron's blend): pt only, instead of data.dataset, with a step count."""
    from hpc_mca.data.blended import parse_blend, parse_split
    from hpc_mca.data.errors import DataError

    data, stage = config.data, config.finetuning.stage
    if get_stage(stage).reads != TEXT:
        text = " or ".join(stages_where("reads", TEXT))
        raise ConfigError(f"data.data_path with finetuning.stage={stage!r}: a blend of indexed "
                          f"corpora is pretraining data; valid: finetuning.stage={text}, or "
                          "data.dataset")
    if data.dataset:
        raise ConfigError("data.data_path and data.dataset are both set; valid: one of them")
    if data.eval_dataset:
        raise ConfigError("data.data_path with data.eval_dataset; valid: data.split's validation "
                          "share (e.g. '98,2,0') for evaluation")
    if config.training.max_steps <= 0:
        raise ConfigError("data.data_path needs training.max_steps > 0: the blend is drawn for "
                          "max_steps × global_batch_size samples")
    try:
        parse_blend(data_path)
        parse_split(data.split or "100,0,0")
    except DataError as err:
        raise ConfigError(str(err)) from None


def _check_data(config: TrainConfig, world_size: int) -> None:
    data, stage = config.data, config.finetuning.stage
    data.seq_length = data.seq_length or data.cutoff_len  # first: the layout rules read it
    if data.data_path is not None:
        _check_blend(config, data.data_path)
    elif data.split is not None:
        raise ConfigError(f"data.split={data.split!r} without data.data_path; valid: data.split "
                          "with data.data_path, or data.val_size for data.dataset")
    elif not data.dataset and not config.datasets_in_code:
        raise ConfigError("data.dataset is required (one or more dataset files)")
    _choice("data.dataset_format", data.dataset_format, DATASET_FORMATS)
    _choice("data.template", data.template, TEMPLATE_NAMES)
    _choice("data.pt_chunking", data.pt_chunking, PT_CHUNKINGS)
    fits = ("auto", *FORMATS_BY_READS[get_stage(stage).reads])
    if data.dataset_format not in fits:
        raise ConfigError(f"data.dataset_format={data.dataset_format!r} does not fit "
                          f"finetuning.stage={stage!r}; valid: {', '.join(fits)}")
    _at_least("data.cutoff_len", data.cutoff_len, 1)
    _at_least("data.pack_alignment", data.pack_alignment, 1)
    _at_least("data.max_samples", data.max_samples, 1)
    _at_least("data.image_min_pixels", data.image_min_pixels, 1)
    _at_least("data.image_max_pixels", data.image_max_pixels, data.image_min_pixels)
    _at_least("data.val_size", data.val_size, 0)
    if data.val_size and data.eval_dataset:
        raise ConfigError("data.val_size and data.eval_dataset are both set; valid: one of them")
    _check_mix(data)
    if data.seq_length < data.cutoff_len:
        raise ConfigError(f"data.seq_length={data.seq_length} is shorter than data.cutoff_len="
                          f"{data.cutoff_len}; valid: >= {data.cutoff_len}")


def _check_mix(data: DataArguments) -> None:
    _choice("data.mix_strategy", data.mix_strategy, MIX_STRATEGIES)
    probs = data.interleave_probs
    if not probs:
        return
    if data.mix_strategy == "concat":
        raise ConfigError("data.interleave_probs needs data.mix_strategy interleave_under or "
                          "interleave_over (it is concat)")
    if len(probs) != len(data.dataset):
        raise ConfigError(f"data.interleave_probs has {len(probs)} values for "
                          f"{len(data.dataset)} datasets in data.dataset; valid: one per dataset")
    if min(probs) < 0 or abs(sum(probs) - 1.0) > 1e-6:
        raise ConfigError(f"data.interleave_probs={probs} must be non-negative and sum to 1 "
                          f"(they sum to {sum(probs):g})")


def _check_profile_steps(window: list[int] | None, max_steps: int) -> None:
    if window is None:
        return
    last = max_steps if max_steps > 0 else None
    if (len(window) != 2 or not 1 <= window[0] <= window[1]
            or (last is not None and window[1] > last)):
        bound = f" <= max_steps ({last})" if last is not None else ""
        raise ConfigError(f"training.profile_steps={window!r}; valid: [first, last] with "
                          f"1 <= first <= last{bound}")


def _check_training(config: TrainConfig, world_size: int) -> None:
    tr = config.training
    if not tr.output_dir:
        raise ConfigError("training.output_dir is required")
    _choice("training.optim", tr.optim, OPTIMIZERS)
    _choice("training.save_optimizer_format", tr.save_optimizer_format, OPTIMIZER_FORMATS)
    for name in tr.report_to:
        _choice("training.report_to", name, REPORT_TO)
    if "none" in tr.report_to and len(tr.report_to) > 1:
        raise ConfigError(f"training.report_to={tr.report_to!r} names none beside a tracker; "
                          "valid: none alone, or trackers without none")
    # The package each tracker needs, checked here so a missing one stops the run before any
    # allocation (hpc_mca.loop.trackers imports them only on rank 0, when the run starts).
    missing = [name for name in tr.report_to if name in TRACKER_PACKAGES
               and importlib.util.find_spec(TRACKER_PACKAGES[name]) is None]
    if missing:
        raise ConfigError(f"training.report_to={tr.report_to!r} needs {', '.join(missing)}, which "
                          "is not installed; valid: pip install 'hpc-mca[trackers]', or "
                          "report_to without it")
    if tr.bf16 and tr.fp16:
        raise ConfigError("training.bf16 and training.fp16 are both true; valid: at most one")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "logging_steps",
                 "save_steps", "eval_steps", "gradient_accumulation_steps", "global_batch_size",
                 "save_total_limit"):
        _at_least(f"training.{name}", getattr(tr, name), 1)
    _check_profile_steps(tr.profile_steps, tr.max_steps)
    for name in ("learning_rate", "weight_decay", "max_grad_norm", "adam_epsilon"):
        _at_least(f"training.{name}", getattr(tr, name), 0.0)
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(tr, name) < 1.0:
            raise ConfigError(f"training.{name}={getattr(tr, name)} must be in [0, 1)")


def _check_schedule(config: TrainConfig, world_size: int) -> None:
    tr = config.training
    if tr.max_steps == 0 or tr.max_steps < -1:
        # HF reads any max_steps <= 0 as "use the epochs"; a 0 that silently trains for three
        # epochs is a surprise, so only -1 (the default) means that here.
        raise ConfigError(f"training.max_steps={tr.max_steps} is not a step count; valid: a "
                          "positive number of optimizer steps, or -1 (num_train_epochs passes "
                          "over the data)")
    if tr.max_steps <= 0 and tr.num_train_epochs <= 0:
        raise ConfigError(f"training.max_steps={tr.max_steps} and training.num_train_epochs="
                          f"{tr.num_train_epochs}: set max_steps > 0 or num_train_epochs > 0")
    if not 0.0 <= tr.warmup_ratio < 1.0:
        raise ConfigError(f"training.warmup_ratio={tr.warmup_ratio} must be in [0, 1)")
    _at_least("training.warmup_steps", tr.warmup_steps, 0)
    # Both set: warmup_steps wins, as in transformers (resolve_warmup_steps).
    # Without max_steps the run length depends on the data; check with a stand-in length
    # that the ratio-based warmup always fits.
    total = tr.max_steps if tr.max_steps > 0 else max(tr.warmup_steps + 1, 1000)
    try:
        scheduler_spec(tr.lr_scheduler_type, tr.lr_scheduler_kwargs, tr.learning_rate,
                       resolve_warmup_steps(tr.warmup_steps, tr.warmup_ratio, total), total)
    except SchedulerError as err:
        raise ConfigError(str(err)) from None


# Megatron-Core settings the standard backend has no counterpart for, with the value that
# means "not used": any other value with training.use_mca=false is refused.
_MEGATRON_ONLY = {
    "parallel.tensor_model_parallel_size": 1, "parallel.pipeline_model_parallel_size": 1,
    "parallel.virtual_pipeline_model_parallel_size": None, "parallel.pipeline_layout": None,
    "parallel.context_parallel_size": 1, "parallel.expert_model_parallel_size": 1,
    "parallel.expert_tensor_parallel_size": None, "parallel.sequence_parallel": False,
    "parallel.use_distributed_optimizer": False, "parallel.overlap_param_gather": False,
    "parallel.optimizer_cpu_offload": False,
    "model.mtp_num_layers": 0, "model.attention_backend": "auto",
    "model.packed_attention": "auto", "model.fusions": None, "training.async_save": False,
    "parallel.overlap_grad_reduce": False,
}


# Settings the standard backend implements one way only: the value it runs, and why.
_STANDARD_FIXED = {
    "training.optim": ("adam", "the standard backend's optimizer is torch's AdamW"),
    "training.save_optimizer_format": ("model_space", "the standard backend's checkpoints hold "
                                       "transformers' optimizer.pt, not a Megatron format"),
    "parallel.calculate_per_token_loss": (True, "the standard backend's loss is always the "
                                          "mean over the global batch's real tokens"),
    "model.attention_backend": ("auto", "the standard backend's attention is the torch backend's "
                                "packed kernel (hpc_mca.models.hf_attention)"),
}
_STANDARD_ALSO = {"model.attention_backend": "torch", "model.fusions": []}
"""A second value the standard backend runs: the attention it always has, named; no fusion,
named."""


def _check_standard_recompute(par: ParallelArguments) -> None:
    """The standard backend recomputes every decoder layer or none (transformers' gradient
    checkpointing): full granularity, one layer per checkpoint, uniform."""
    recompute = (par.recompute_granularity, par.recompute_method, par.recompute_num_layers)
    if recompute not in ((None, None, None), ("full", "uniform", 1), ("full", None, 1)):
        raise ConfigError(f"parallel.recompute_granularity={par.recompute_granularity!r}, "
                          f"recompute_method={par.recompute_method!r}, recompute_num_layers="
                          f"{par.recompute_num_layers!r} with training.use_mca=false: the standard "
                          "backend recomputes every decoder layer (transformers' gradient "
                          "checkpointing) or none; valid: gradient_checkpointing=true (full, "
                          "uniform, 1), none, or training.use_mca=true")


def _check_standard(config: TrainConfig, world_size: int) -> None:
    """The standard backend: a whole model per rank; data parallelism over groups of
    ``sequence_parallel_size`` consecutive ranks that share each row (Ulysses)."""
    par, tr = config.parallel, config.training
    whole_model = ("the standard backend keeps a whole model on every rank (data and Ulysses "
                   "sequence parallelism only)")
    fixed = {**{k: (v, whole_model) for k, v in _MEGATRON_ONLY.items()}, **_STANDARD_FIXED}
    for dotted, (runs, why) in fixed.items():
        section, name = dotted.split(".")
        value = getattr(getattr(config, section), name)
        if value != runs and value != _STANDARD_ALSO.get(dotted, runs):
            also = f", {_STANDARD_ALSO[dotted]!r}" if dotted in _STANDARD_ALSO else ""
            raise ConfigError(f"{dotted}={value!r} with training.use_mca=false: {why}; valid: "
                              f"{runs!r}{also}, or training.use_mca=true")
    _check_standard_recompute(par)
    sp, shape = par.sequence_parallel_size, model_shape(config.model.model_name_or_path)
    if shape.is_moe and not shape.moe_router_expert_bias:
        raise ConfigError(f"model.model_name_or_path={config.model.model_name_or_path!r} is a "
                          f"mixture of experts ({model_type(config.model.model_name_or_path)}) "
                          "with training.use_mca=false: the standard backend's loss has no router "
                          "load-balancing term; valid: a dense model or one whose router is "
                          "balanced by its bias (glm4_moe, deepseek_v3), or training.use_mca=true")
    if shape.is_mla and sp > 1:
        raise ConfigError(f"parallel.sequence_parallel_size={sp} with multi-latent attention "
                          f"({model_type(config.model.model_name_or_path)}) and "
                          "training.use_mca=false: Ulysses is not built for its query/key and "
                          "value heads of different widths; valid: 1, or training.use_mca=true")
    if shape.vision_params and sp > 1:  # a slice's image tokens would not match its images
        raise ConfigError(f"parallel.sequence_parallel_size={sp} with a vision-language model "
                          f"({model_type(config.model.model_name_or_path)}) and "
                          "training.use_mca=false: Ulysses does not split a row's images over "
                          "the ranks; valid: 1")
    valid = [n for n in range(1, world_size + 1) if world_size % n == 0
             and shape.num_attention_heads % n == 0 and shape.num_query_groups % n == 0]
    if world_size % sp or shape.num_attention_heads % sp or shape.num_query_groups % sp:
        raise ConfigError(f"parallel.sequence_parallel_size={sp} must divide the world size "
                          f"{world_size}, num_attention_heads={shape.num_attention_heads} and "
                          f"num_key_value_heads={shape.num_query_groups} (Ulysses splits heads "
                          f"over the ranks); valid: {', '.join(map(str, valid))}")
    lines = check_layout(Layout(), world_size // sp, shape, global_batch_size=tr.global_batch_size,
                         micro_batch_size=tr.per_device_train_batch_size)
    if lines:
        raise ConfigError("\n".join(our_names(line) for line in lines))
    par.data_parallel_size = world_size // sp
    _derive_batch(tr, par.data_parallel_size)


def _check_parallel(config: TrainConfig, world_size: int) -> None:
    par, tr, data = config.parallel, config.training, config.data
    _at_least("parallel.sequence_parallel_size", par.sequence_parallel_size, 1)
    if not tr.use_mca:
        _check_standard(config, world_size)
        return
    if par.sequence_parallel_size != 1:
        raise ConfigError(f"parallel.sequence_parallel_size={par.sequence_parallel_size} is the "
                          "standard backend's Ulysses sequence parallelism; valid: 1 with "
                          "training.use_mca=true (Megatron-Core splits sequences with "
                          "parallel.context_parallel_size)")
    _choice("parallel.recompute_granularity", par.recompute_granularity,
            (None, "full", "selective"))
    _choice("parallel.recompute_method", par.recompute_method, (None, "uniform", "block"))
    if par.recompute_method is not None and par.recompute_granularity != "full":
        raise ConfigError(f"parallel.recompute_method={par.recompute_method!r} needs "
                          "parallel.recompute_granularity='full'")
    if par.recompute_granularity == "full" and (par.recompute_num_layers or 0) < 1:
        raise ConfigError(f"parallel.recompute_num_layers={par.recompute_num_layers!r} must be "
                          ">= 1 with parallel.recompute_granularity='full'")
    _check_recompute_modules(config)
    _check_megatron_combinations(config)
    layout = layout_of(par)
    lines = check_layout(
        layout, world_size, model_shape(config.model.model_name_or_path),
        global_batch_size=tr.global_batch_size, micro_batch_size=tr.per_device_train_batch_size,
        seq_length=data.seq_length, sequence_packing=data.sequence_packing,
        sequence_parallel=par.sequence_parallel, cp_comm_type=par.cp_comm_type,
        mtp_num_layers=max(0, config.model.mtp_num_layers))
    if lines:
        raise ConfigError("\n".join(our_names(line) for line in lines))
    _check_pack_alignment(config)
    par.data_parallel_size = world_size // layout.model_parallel_size
    _derive_batch(tr, par.data_parallel_size)


def _check_recompute_modules(config: TrainConfig) -> None:
    """Each module named once, one this model has: Megatron-Core would silently skip a
    dense model's moe or a mixture of experts' mlp (every layer of a supported MoE is one)."""
    modules = config.parallel.recompute_modules
    if modules is None:
        return
    shape = model_shape(config.model.model_name_or_path)
    has = recompute_parts(shape)
    valid = f"valid: one or more of {', '.join(has)}"
    if not modules or len(set(modules)) != len(modules):
        raise ConfigError(f"parallel.recompute_modules={modules!r} names no module or one twice; "
                          f"{valid}")
    for module in modules:
        if module not in has:
            why = {"mlp": "every layer of this mixture of experts is an MoE layer (moe)",
                   "mla_up_proj": "this model has no multi-latent attention",
                   "moe": "this model has no MoE layers (mlp recomputes its MLPs)",
                   "moe_act": "Megatron-Core recomputes it only in grouped-GEMM experts, which "
                              "this trainer does not build (moe recomputes the whole layer)"
                   }.get(module, "not a module this trainer's layers have")
            raise ConfigError(f"parallel.recompute_modules has {module!r}: {why}; {valid}")
    if "layernorm" in modules and "layer" in (config.model.fusions or ()):
        # Seen on CPU: dynamo, tracing Megatron's output-discarding checkpoint inside the
        # compiled layer, fails at its first forward; never run on a GPU.
        raise ConfigError("parallel.recompute_modules has 'layernorm' with model.fusions "
                          "'layer': the norms' output-discarding checkpoint does not run inside "
                          "compiled layers; valid: leave layernorm out, or drop the 'layer' "
                          "fusion")


def _check_megatron_combinations(config: TrainConfig) -> None:
    """Settings that Megatron-Core cannot run together (or that would train something else);
    fills in the sequence-parallel and expert-TP values a TP size implies."""
    par, moe = config.parallel, model_shape(config.model.model_name_or_path).is_moe
    for name in ("overlap_param_gather", "optimizer_cpu_offload"):
        if getattr(par, name) and not par.use_distributed_optimizer:
            # Megatron-LM refuses the offload alike; built anyway, its optimizer fails
            raise ConfigError(f"parallel.{name}=true needs parallel.use_distributed_optimizer"
                              "=true")
    if not par.calculate_per_token_loss:
        raise ConfigError("parallel.calculate_per_token_loss=false: the loss functions return "
                          "token sums that the step divides by the global batch's real tokens "
                          "(hpc_mca.trainer.step); valid: true")
    _choice("parallel.cp_comm_type", par.cp_comm_type, CP_COMM_TYPES)
    if par.tensor_model_parallel_size == 1:
        par.sequence_parallel = False
    elif not par.sequence_parallel and moe:
        # Megatron's MoE layer raises this at the first forward (a traceback after tokenizing)
        raise ConfigError(f"parallel.sequence_parallel=false with parallel.tensor_model_parallel_"
                          f"size={par.tensor_model_parallel_size} on a mixture of experts "
                          f"({model_type(config.model.model_name_or_path)}): Megatron-Core's MoE "
                          "layer does not train under tensor parallelism without sequence "
                          "parallelism; valid: parallel.sequence_parallel=true, or "
                          "parallel.tensor_model_parallel_size=1")
    if par.expert_tensor_parallel_size is None:
        par.expert_tensor_parallel_size = par.tensor_model_parallel_size
    elif par.expert_tensor_parallel_size not in (1, par.tensor_model_parallel_size) and not moe:
        # (1, "experts not split", is what the planner writes for every model)
        raise ConfigError(f"parallel.expert_tensor_parallel_size="
                          f"{par.expert_tensor_parallel_size} splits MoE experts, and "
                          f"{config.model.model_name_or_path!r} has none; valid: leave it unset")


def _check_pack_alignment(config: TrainConfig) -> None:
    """Under CP every packed sample must split into 2·CP chunks."""
    cp, align = config.parallel.context_parallel_size, config.data.pack_alignment
    if cp > 1 and align is not None and align % (2 * cp):
        raise ConfigError(f"data.pack_alignment={align} is not a multiple of 2·CP={2 * cp} "
                          f"(parallel.context_parallel_size={cp}); valid: "
                          f"{', '.join(str(2 * cp * k) for k in (1, 2, 4))}, or leave it unset")


def _derive_batch(tr: TrainingArguments, dp: int) -> None:
    per_step = tr.per_device_train_batch_size * dp
    if tr.global_batch_size is None:
        tr.gradient_accumulation_steps = tr.gradient_accumulation_steps or 1
        tr.global_batch_size = per_step * tr.gradient_accumulation_steps
        return
    derived = tr.global_batch_size // per_step  # divisibility checked by check_layout
    if tr.gradient_accumulation_steps not in (None, derived):
        raise ConfigError(
            f"training.gradient_accumulation_steps={tr.gradient_accumulation_steps} disagrees "
            f"with training.global_batch_size={tr.global_batch_size} / (per_device_train_batch_"
            f"size×data_parallel_size={per_step}); valid: {derived} or leave it unset")
    tr.gradient_accumulation_steps = derived


_Rule = Callable[["TrainConfig", int], None]
RESOLVE_STEPS: tuple[tuple[_Rule, tuple[_Rule, ...]], ...] = (
    (_check_stage, ()),
    (check_scopes, ()),
    (_check_model, ()),
    (_check_finetuning, (_check_stage, _check_model)),
    (_check_data, (_check_stage,)),
    (_check_training, ()),
    (_check_schedule, ()),
    (_check_parallel, (_check_model,)),
    (check_micro_step, (_check_stage, _check_parallel)),
    (check_run_settings, ()),
)
"""The rules in order, each with the steps whose derived values (or model) it needs: a step
runs unless one of those failed, so one message reports the problems of every section."""
