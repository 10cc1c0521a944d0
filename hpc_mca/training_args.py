"""The arguments a training script parses, in ROLL's mcore_adapter shape.

:class:`Seq2SeqTrainingArguments` (and :class:`TrainingArguments`) is transformers' class of the
same name, every field and method of it, plus :class:`MegatronArguments`: the 57 Megatron
fields of ROLL's ``mcore_adapter.training_args`` under their names, and the settings of this
trainer that neither has (``global_batch_size``, ``hang_timeout`` ...). It therefore parses
beside LLaMA-Factory's ``ModelArguments``, ``DataArguments``, ``FinetuningArguments`` and
``GeneratingArguments`` with ``HfArgumentParser``, and LLaMA-Factory's ``get_dataset`` takes it:

    training_args, model_args, data_args, finetuning_args, generating_args = HfArgumentParser(
        (Seq2SeqTrainingArguments, ModelArguments, DataArguments, FinetuningArguments,
         GeneratingArguments)).parse_args_into_dataclasses()

It is a view onto the one run config (:class:`~hpc_mca.config.sections.TrainConfig`), not a
config of its own: :meth:`~MegatronArguments.to_config` reads every field through the loader a
YAML file goes through (:func:`hpc_mca.config.loading.load_items`), over the config the view
was made from (:meth:`~MegatronArguments.from_config`, ``from_yaml``; the defaults for a
parsed command line), which supplies what this class has no field for (the model, the data,
the stage). So a value here means what the same key means in a YAML file, and one this trainer
cannot honour is refused in one line:

* a field the run config has (``learning_rate``, ``tensor_model_parallel_size`` ...) is read
  with its value, transformers' defaults included (``per_device_train_batch_size`` 8,
  ``logging_steps`` 500, ``save_steps`` 500, ``report_to`` none: what transformers' and ROLL's
  trainers do);
* the interval strategies (``eval_strategy``, ``save_strategy``, ``logging_strategy``) are
  read too, as LLaMA-Factory's keys are (``eval_strategy: no`` means no evaluation between
  steps, whatever ``eval_steps`` says, as in transformers);
* ROLL's Megatron fields are translated by :data:`MEGATRON_FIELDS` (each honoured, or refused
  with what to use instead; the translation is :mod:`hpc_mca.config.view`);
* any other transformers field is refused when it differs from transformers' default;
* the fields a script reads and the trainer does not (``do_train``, ``do_eval``,
  ``do_predict``, ``predict_with_generate``, ``generation_*``, ``local_rank``) are left to it.

Defaults differ from ROLL's where ROLL's default is something this trainer does not run, so
that the default says what happens: ``calculate_per_token_loss`` true (the loss is the mean
over the global batch's tokens, as transformers' ``average_tokens_across_devices``),
``moe_token_dispatcher_type`` alltoall, ``overlap_p2p_comm`` and ``delay_grad_reduce`` false,
``ckpt_format`` torch_dist. ROLL's value, given explicitly, is refused in one line.

Two environment variables of the batch script reach a script here (``sbatch/train.sbatch``):
``HPC_MCA_RUN_DIR``, the job's run directory, is the ``output_dir`` of a script that leaves it
unset; ``HPC_MCA_PLAN_OVERRIDES``, the planned layout (``key=value`` pairs), sets the fields the
script left at their defaults.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import transformers

from hpc_mca.config.input import ConfigError
from hpc_mca.config.loading import config_items, load_items
from hpc_mca.config.sections import TrainConfig
from hpc_mca.config.view import MEGATRON_FIELDS, NOT_IN_VIEW, config_of, view_values
from hpc_mca.rundir import RUN_DIR_ENV

__all__ = ["MEGATRON_FIELDS", "NOT_IN_VIEW", "MegatronArguments", "Seq2SeqTrainingArguments",
           "TrainingArguments"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class MegatronArguments:
    """The Megatron and hpc-mca fields of the script arguments (module docstring). Names and
    defaults are ROLL's except where the module docstring says."""

    # --- hpc-mca's own (run-config fields that transformers and ROLL do not have); read before
    # ROLL's fields, which may set the same run-config field (distrib_optim_fully_reshardable)
    global_batch_size: int | None = field(default=None, metadata=_help(
        "Rows per optimizer step over all ranks; derives gradient_accumulation_steps."))
    overwrite_output_dir: bool = field(default=False, metadata=_help(
        "Start afresh: an earlier run in output_dir is moved aside."))
    profile_steps: list[int] | None = field(default=None, metadata=_help("[first, last] steps to profile."))
    hang_timeout: int | None = field(default=None, metadata=_help(
        "Seconds without a step before the batch script's watchdog requeues."))
    async_save: bool = field(default=False, metadata=_help("Write checkpoint shards in the background."))
    save_optimizer_format: str = field(default="model_space", metadata=_help(
        "model_space, fully_reshardable or dp_reshardable."))
    export_hf_dir: str | None = field(default=None, metadata=_help(
        "After the last step, write the HF model (LoRA: the PEFT adapter) here."))
    export_merged_dir: str | None = field(default=None, metadata=_help(
        "LoRA: after the last step, write the merged HF model here."))
    pipeline_layout: list[int] | None = field(default=None, metadata=_help(
        "Transformer layers of each pipeline stage."))
    cp_comm_type: str = field(default="all_gather", metadata=_help("all_gather, a2a or p2p."))
    data_parallel_size: int | None = field(default=None, metadata=_help("Derived; giving it checks it."))
    sequence_parallel_size: int = field(default=1, metadata=_help(
        "Standard backend: Ulysses sequence parallelism."))
    # --- parallel layout (ROLL's DistributingParallelArguments)
    tensor_model_parallel_size: int | None = field(default=None, metadata=_help("TP ranks; None = 1."))
    pipeline_model_parallel_size: int | None = field(default=None, metadata=_help("Pipeline stages; None = 1."))
    sequence_parallel: bool = field(default=False, metadata=_help(
        "Split norm and residual activations along the sequence over the TP ranks."))
    virtual_pipeline_model_parallel_size: int | None = field(default=None, metadata=_help(
        "Model chunks per pipeline rank (interleaved schedule)."))
    context_parallel_size: int | None = field(default=None, metadata=_help("CP ranks; None = 1."))
    expert_model_parallel_size: int | None = field(default=None, metadata=_help("EP ranks; None = 1."))
    expert_tensor_parallel_size: int | None = field(default=None, metadata=_help(
        "TP ranks inside an expert; None = tensor_model_parallel_size."))
    account_for_embedding_in_pipeline_split: bool | None = field(default=None, metadata=_help(
        "Refused when true: use pipeline_layout."))
    account_for_loss_in_pipeline_split: bool | None = field(default=None, metadata=_help(
        "Refused when true: use pipeline_layout."))
    pipeline_model_parallel_layout: str | None = field(default=None, metadata=_help(
        "Refused: use pipeline_layout (transformer layers per stage)."))
    overlap_p2p_comm: bool = field(default=False, metadata=_help(
        "Refused when true: pipeline sends are blocking here (ROLL's default is true)."))
    variable_seq_lengths: bool = field(default=False, metadata=_help(
        "Refused when true: under PP the micro-batches of a step are padded to one length."))
    recompute_granularity: str | None = field(default=None, metadata=_help("None, full or selective."))
    recompute_method: str | None = field(default=None, metadata=_help("With full: uniform or block."))
    recompute_modules: None | str | list[str] = field(default=None, metadata=_help(
        "With selective: comma-separated parts (core_attn, layernorm, mlp, moe)."))
    recompute_num_layers: int | None = field(default=None, metadata=_help(
        "With full: layers per group (uniform) or per stage (block)."))
    bias_activation_fusion: bool = field(default=False, metadata=_help(
        "The fused SwiGLU (model.fusions swiglu)."))
    apply_rope_fusion: bool = field(default=False, metadata=_help("The fused RoPE (model.fusions rope)."))
    cross_entropy_loss_fusion: bool = field(default=False, metadata=_help(
        "The fused cross entropy (model.fusions cross_entropy)."))
    moe_layer_recompute: bool = field(default=False, metadata=_help(
        "Refused when true: use recompute_granularity=selective with recompute_modules=moe."))
    moe_token_dispatcher_type: str = field(default="alltoall", metadata=_help(
        "alltoall (ROLL's default allgather is refused: gloo has no reduce-scatter)."))
    moe_aux_loss_coeff: float | None = field(default=None, metadata=_help(
        "Refused when set: the aux loss weight is the HF config's router_aux_loss_coef."))
    moe_grouped_gemm: bool | None = field(default=None, metadata=_help(
        "Refused when true: experts run as separate GEMMs (local spec)."))
    moe_expert_capacity_factor: float | None = field(default=None, metadata=_help(
        "Refused when set: routing is dropless."))
    moe_pad_expert_input_to_capacity: bool | None = field(default=None, metadata=_help(
        "Refused when true: routing is dropless."))
    moe_token_drop_policy: str | None = field(default=None, metadata=_help(
        "Refused when set: routing is dropless."))
    moe_shared_expert_overlap: bool = field(default=False, metadata=_help("Refused when true."))
    moe_enable_routing_replay: bool = field(default=False, metadata=_help("Refused when true."))
    moe_router_dtype: str | None = field(default=None, metadata=_help("Refused when set."))
    mtp_num_layers: int | None = field(default=0, metadata=_help("Multi-token prediction depths; 0 = none."))
    calculate_per_token_loss: bool = field(default=True, metadata=_help(
        "The loss is the mean over the global batch's tokens (ROLL's default false is refused)."))
    transformer_impl: str | None = field(default=None, metadata=_help(
        "local (Megatron's local layers, what is built here); transformer_engine is refused."))
    cuda_graph_impl: str | None = field(default=None, metadata=_help("Refused when set."))
    cuda_graph_scope: str = field(default="full", metadata=_help(
        "Read only with cuda_graph_impl, which is refused."))
    fp8_recipe: str | None = field(default=None, metadata=_help("Refused when set: no fp8 training."))
    fp8_param: bool = field(default=False, metadata=_help("Refused when true: no fp8 training."))
    fp8: str | None = field(default=None, metadata=_help("Refused when set: no fp8 training."))
    additional_configs: None | str | dict[str, Any] = field(default_factory=dict, metadata=_help(
        "Refused when not empty: name each setting by its field."))
    # --- optimizer, DDP and checkpoints (ROLL's MegatronArguments)
    accumulate_allreduce_grads_in_fp32: bool = field(default=False, metadata=_help(
        "Gradients are accumulated and reduced in fp32 here whatever it says (true under "
        "bf16/fp16, as ROLL sets it)."))
    use_distributed_optimizer: bool = field(default=False, metadata=_help(
        "Shard optimizer state over data-parallel ranks."))
    distrib_optim_fully_reshardable: bool = field(default=False, metadata=_help(
        "save_optimizer_format fully_reshardable."))
    distrib_optim_fully_reshardable_mem_efficient: bool = field(default=False, metadata=_help(
        "Refused when true: use save_optimizer_format."))
    overlap_grad_reduce: bool = field(default=False, metadata=_help(
        "Overlap the gradient reduction with backward."))
    delay_grad_reduce: bool = field(default=False, metadata=_help(
        "Refused when true: reductions start as their buckets fill (ROLL's default is true)."))
    overlap_param_gather: bool = field(default=False, metadata=_help(
        "Overlap the parameter all-gather with forward (distributed optimizer)."))
    check_for_nan_in_loss_and_grad: bool = field(default=True, metadata=_help(
        "Non-finite losses and gradients are always found: the step is skipped and counted."))
    ddp_average_in_collective: bool = field(default=False, metadata=_help("Refused when true."))
    ddp_bucket_size: int | None = field(default=None, metadata=_help("Refused when set."))
    optimizer: str = field(default="adam", metadata=_help("adam or sgd."))
    optimizer_cpu_offload: bool = field(default=False, metadata=_help("Keep optimizer state on the CPU."))
    optimizer_offload_fraction: float = field(default=0.0, metadata=_help(
        "Refused unless 0 (with optimizer_cpu_offload all of it is offloaded)."))
    save_hf_model: bool = field(default=False, metadata=_help("Refused when true: use export_hf_dir."))
    save_merged_model: bool = field(default=False, metadata=_help(
        "Refused when true: use export_merged_dir."))
    ckpt_format: str = field(default="torch_dist", metadata=_help(
        "torch_dist: Megatron's distributed checkpoints (ROLL's legacy is refused)."))
    ckpt_d2h_non_blocking: bool = field(default=False, metadata=_help("Refused when true."))
    sequence_packing: bool = field(default=False, metadata=_help(
        "Pack rows (data.sequence_packing; refused beside a data_collator)."))
    compile_warmup: bool = field(default=False, metadata=_help("Refused when true."))
    # transformers' field with None for "derived" (its default 1 would contradict a
    # global_batch_size); the type widens transformers' int on purpose.
    gradient_accumulation_steps: int | None = field(default=None, metadata=_help(
        "Micro-batches per optimizer step on each rank; None = 1, or derived from "
        "global_batch_size (transformers' default is 1)."))
    base_config: TrainConfig | None = field(default=None, init=False, repr=False, compare=False)
    """The run config this view was made from (:meth:`from_config`): the model, data and stage
    settings, and the fields this class lacks. None: the defaults."""

    def __post_init__(self) -> None:
        """ROLL's normalisations (recompute_modules split at commas, fp32 gradient reduction under half
        precision), the batch script's run directory as an unset ``output_dir``, then
        transformers' own checks."""
        if isinstance(self.recompute_modules, str):
            self.recompute_modules = [p.strip() for p in self.recompute_modules.split(",") if p.strip()]
        if getattr(self, "bf16", False) or getattr(self, "fp16", False):
            self.accumulate_allreduce_grads_in_fp32 = True
        run_dir = os.environ.get(RUN_DIR_ENV)
        this: Any = self  # a mixin: output_dir is transformers' field
        if this.output_dir is None and run_dir:
            this.output_dir = run_dir
        _on_cpu_if_no_gpu(this)
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:  # transformers' (this class alone has none above it)
            parent()

    # ---- the view onto the run config ---------------------------------------------------------

    @classmethod
    def from_config(cls: type[_Args], config: TrainConfig, **overrides: object) -> _Args:
        """The view of ``config``: these fields take its values (``overrides`` win), and
        :meth:`to_config` gives ``config`` back with the view's values. Raises ConfigError
        when transformers refuses a value (its ``__post_init__`` checks)."""
        values = view_values(cls, config)
        values.update(overrides)
        try:
            args = cls(**values)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{cls.__name__}: {' '.join(str(err).split())}") from None
        args.base_config = copy.deepcopy(config)
        return args

    @classmethod
    def from_yaml(cls: type[_Args], path: str | os.PathLike[str] | None, overrides: Iterable[str] = (),
                  **kwargs: object) -> _Args:
        """A YAML run config (its relative paths read next to it) with ``key=value``
        overrides, as ``hpc-mca train CONFIG key=value`` reads them; ``kwargs`` set fields."""
        config, problems = load_items(config_items(path, overrides))
        if problems:
            raise ConfigError("\n".join(problems))
        return cls.from_config(config, **kwargs)

    def to_config(self, base: TrainConfig | None = None) -> TrainConfig:
        """The run config: ``base`` (default: :attr:`base_config`, else the defaults) with this
        view's fields read over it as a YAML file's keys, then the batch script's run
        directory and planned layout (module docstring). Nothing of ``self`` or ``base``
        changes. Raises ConfigError with every problem, one line each."""
        return config_of(self, base if base is not None else self.base_config)

    def resolve(self, world_size: int, base: TrainConfig | None = None) -> TrainConfig:
        """:meth:`to_config` with the cross-field rules checked for ``world_size`` ranks and
        the derived fields filled in (a new config; see TrainConfig.resolve)."""
        return self.to_config(base).resolve(world_size)


_Args = TypeVar("_Args", bound=MegatronArguments)


@dataclass
class TrainingArguments(MegatronArguments, transformers.TrainingArguments):  # type: ignore[misc]
    """transformers' ``TrainingArguments`` with the Megatron fields (module docstring)."""


@dataclass
class Seq2SeqTrainingArguments(MegatronArguments, transformers.Seq2SeqTrainingArguments):  # type: ignore[misc]
    """transformers' ``Seq2SeqTrainingArguments`` with the Megatron fields (module docstring)."""


def _on_cpu_if_no_gpu(args: transformers.TrainingArguments) -> None:
    """transformers refuses bf16/fp16 on a machine without a GPU unless ``use_cpu`` says the
    run is on the CPU; on such a machine it is (this trainer's ranks run where CUDA is)."""
    import torch

    if (args.bf16 or args.fp16) and not torch.cuda.is_available():
        args.use_cpu = True
