"""What a plan tells the trainer: ``key=value`` overrides for the keys the user left open, and
the recompute level in the planner's names and the config's (both ways)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import OpsError

if TYPE_CHECKING:
    from hpc_mca.config.sections import ParallelArguments
    from hpc_mca.topology import Plan

    from .jobplan import PlanOptions

# CLI layout flag -> trainer config key.
LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "vp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
               "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}


def plan_overrides(result: Plan, options: PlanOptions, explicit: set[str]) -> list[str]:
    """``key=value`` for what the CLI set and what the planner chose where the user did not."""
    if result.backend == "standard":
        return _standard_overrides(result, options, explicit)
    lay = result.layout
    chosen: dict[str, Any] = {
        "tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
        "virtual_pipeline_model_parallel_size": lay.vp, "context_parallel_size": lay.cp,
        "expert_model_parallel_size": lay.ep, "expert_tensor_parallel_size": lay.etp,
        # An uneven split as the config writes it (15,16,16,...); null for an even one.
        "pipeline_layout": ",".join(map(str, lay.pipeline_layout)) if lay.pipeline_layout else None,
        "per_device_train_batch_size": result.micro_batch_size,
        "global_batch_size": result.request.global_batch_size,
        "use_distributed_optimizer": result.use_distributed_optimizer,
        "sequence_parallel": result.sequence_parallel,
        # The step-time estimate assumes it; Megatron's DDP leaves it off by default.
        "overlap_grad_reduce": result.overlap_grad_reduce,
        **_recompute(result.recompute),
    }
    cli_set = {LAYOUT_KEYS[f] for f in LAYOUT_KEYS if getattr(options, f) is not None}
    if options.pp is not None or options.vp is not None:
        cli_set.add("pipeline_layout")  # follows the pipeline size the CLI forced
    if options.micro_batch_size is not None:
        cli_set.add("per_device_train_batch_size")
    if options.global_batch_size is not None:
        cli_set.add("global_batch_size")
    if options.recompute is not None:
        cli_set.update(_recompute(options.recompute))
    if options.distributed_optimizer is not None:
        cli_set.add("use_distributed_optimizer")
    out = _stage_precision_lora(options)
    for key, value in chosen.items():
        if key == "recompute_modules" and value is None and key not in explicit:
            continue  # nothing to clear: left out rather than written null on every plan
        if key in cli_set or key not in explicit:
            out.append(f"{key}={_yaml(value)}")
    return out


def _standard_overrides(result: Plan, options: PlanOptions, explicit: set[str]) -> list[str]:
    """The standard backend's trainer refuses every Megatron key, so only the batch and the
    Ulysses size go to it: each where the CLI set it or the config left it open (an SP of 1
    the user never mentioned is the trainer's default and is left out)."""
    out = _stage_precision_lora(options)
    batch = {"per_device_train_batch_size": (result.micro_batch_size,
                                             options.micro_batch_size is not None),
             "global_batch_size": (result.request.global_batch_size,
                                   options.global_batch_size is not None)}
    for key, (value, cli_set) in batch.items():
        if cli_set or key not in explicit:
            out.append(f"{key}={value}")
    sp = result.sequence_parallel_size
    if options.sp is not None or ("sequence_parallel_size" not in explicit and sp != 1):
        out.append(f"parallel.sequence_parallel_size={sp}")
    return out


def config_recompute(par: ParallelArguments) -> str:
    """The config's recompute as the planner names it: ``block:N`` for full granularity with
    the block method (the first N layers of each chunk), full for uniform (sized as one layer
    a group), ``selective:A,B`` for the layer parts recompute_modules names (selective alone
    is Megatron's default, core_attn)."""
    if par.recompute_granularity == "full" and par.recompute_method == "block" \
            and par.recompute_num_layers:
        return f"block:{par.recompute_num_layers}"
    modules = par.recompute_modules
    if par.recompute_granularity == "selective" and modules is not None and modules != ["core_attn"]:
        return "selective:" + ",".join(modules)
    return par.recompute_granularity or "none"


def _recompute(recompute: str) -> dict[str, Any]:
    """The config keys of the planner's ``recompute``; recompute_modules only with a
    selective one (the rules refuse it otherwise)."""
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1, "recompute_modules": None}
    if recompute.startswith("block:"):
        return {"recompute_granularity": "full", "recompute_method": "block",
                "recompute_num_layers": int(recompute.split(":", 1)[1]),
                "recompute_modules": None}
    level, _, modules = recompute.partition(":")
    # The method and layer count belong to full recomputation only (refused otherwise)
    return {"recompute_granularity": None if level == "none" else level,
            "recompute_method": None, "recompute_num_layers": None,
            "recompute_modules": f"[{modules}]" if modules else None}


def _stage_precision_lora(options: PlanOptions) -> list[str]:
    out = []
    if options.stage is not None:
        out.append(f"stage={options.stage}")
    if options.precision is not None:
        if options.precision == "fp8":
            raise OpsError("precision='fp8' has no trainer setting yet; valid: bf16, fp16, fp32")
        out += [f"bf16={_yaml(options.precision == 'bf16')}",
                f"fp16={_yaml(options.precision == 'fp16')}"]
    if options.lora is not None:
        out.append(f"finetuning_type={'lora' if options.lora else 'full'}")
    return out


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
