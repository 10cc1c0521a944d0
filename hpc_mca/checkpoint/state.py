"""What a checkpoint holds, as one Megatron sharded state dict, and how it is put back.

Keys of the sharded state dict (``dist_checkpointing`` stores ShardedTensors in the torch_dist
files and everything else as the "common" state written once)::

    model | model0, model1, ...   the GPTModel chunk(s), canonical keys ("decoder.layers.3...")
    optimizer                    Megatron optimizer; the distributed optimizer's state as
                                 training.save_optimizer_format says: model_space (each rank's
                                 slices as boxes of model-space tensors, see .model_space: any
                                 TP/PP/DP, no gather), Megatron's fully_reshardable (the same
                                 tensors, gathered over DP first) or dp_reshardable (DP shards)
    lr_scheduler                 OptimizerParamScheduler.state_dict() (common)
    trainer                      the run's counters: global_step, consumed_samples,
                                 skipped_iters (common; saved and put back as one unit)
    config                       the resolved run config as a dict (common)
    rng_state                    per-rank RNG states: ShardedObject of global shape (world,)

What a checkpoint takes from the training loop is the :class:`Resumable` protocol: the model
chunks and the optimizer (sharded and loaded in place, being Megatron's), the run's counters
(:class:`Counters`, a torch ``Stateful``) and the loop's own small state (:class:`LoopState`),
each through its ``state_dict``/``load_state_dict``. The checkpointer never reads or writes
anything else of the loop.

The torch AdamW fallback (no Apex/TE) keeps a per-parameter ``step`` tensor that Megatron's
distributed optimizer handles only half-way: ``state_dict()`` reads it from every parameter
(a fresh optimizer has none: :func:`init_optimizer_state` gives it one to build the load
template), both formats save it in the param groups, putting fully_reshardable parameter
state back fails with KeyError('step') in ``_set_main_param_and_optimizer_states``, and
``load_state_dict`` hands every parameter the SAME step tensor, which torch AdamW then
increments once per parameter per step (dp_reshardable "silently restores a wrong step").
:func:`load_optimizer` therefore loads that optimizer in two explicit halves: the param
groups (which carry the step) through ``load_state_dict`` without the parameter state, then
the parameter state with ``step`` set aside while it is copied in, and each parameter gets
its own copy of the step back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
import torch.distributed as dist

from hpc_mca.config.sections import RESHARDABLE_FORMATS
from hpc_mca.models.weights import (
    unwrap,  # GPTModel inside DDP/Float16Module: wrapper-free keys
)

from . import model_space

if TYPE_CHECKING:  # megatron is imported lazily, inside the functions that use it
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule


class Counters(Protocol):
    """The run's counters as a checkpoint sees them (:class:`hpc_mca.loop.counters.RunCounters`:
    global_step, consumed_samples, skipped_iters): a torch ``Stateful`` whose state is saved
    under ``trainer`` and put back whole."""

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None: ...


class LoopState(TypedDict, total=False):
    """The training loop's resumable state beside its model, optimizer and counters."""

    lr_scheduler: dict[str, Any]
    """``OptimizerParamScheduler.state_dict()``."""
    rng_state: dict[str, Any]
    """This rank's RNG states (:func:`hpc_mca.runtime.rng.collect_rng`); on load present only
    when the layout is unchanged (per-rank streams mean nothing on another layout)."""


class Resumable(Protocol):
    """A training loop as its checkpointer sees it (:class:`hpc_mca.trainer.trainer.Trainer`)."""

    model: list[torch.nn.Module]
    """The DDP-wrapped model chunks (this rank's pipeline stages)."""
    optimizer: MegatronOptimizer
    """The Megatron optimizer over ``model`` (a ChainedOptimizer when there are several)."""

    @property
    def counters(self) -> Counters:
        """The run's counters, saved and restored as one unit."""
        ...

    def state_dict(self) -> LoopState: ...

    def load_state_dict(self, state: LoopState) -> None: ...


def sharded_metadata(optimizer_format: str) -> dict[str, Any]:
    """Metadata that steers the model's and the optimizer's sharded_state_dict
    (``optimizer_format``: a distributed-optimizer sharding type, or "plain")."""
    from megatron.core import parallel_state

    metadata: dict[str, Any] = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if optimizer_format in RESHARDABLE_FORMATS:
        metadata["distrib_optim_sharding_type"] = optimizer_format
        # All-gather instead of gathering on DP rank 0 only: every DP rank then writes a share.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return metadata


def model_state(chunks: list[torch.nn.Module], metadata: dict[str, Any]) -> dict[str, Any]:
    models: list[MegatronModule] = [unwrap(chunk) for chunk in chunks]  # GPTModels, no wrappers
    states = [_trained_only(model, model.sharded_state_dict(metadata=metadata)) for model in models]
    if len(models) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def _trained_only(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The entries of the parameters that train. Frozen ones (the base model under LoRA, the
    untrained layers under freeze) are the base model's: every start loads them from its HF
    weights (or its seeded init), so a checkpoint holds only the adapters (or the trained
    layers) and the run records which base they belong to."""
    from hpc_mca.models.freeze import trains_part

    params = list(model.parameters())
    # finetuning_type freeze: some layers of a stacked layer tensor would be missing, which
    # Megatron refuses; the trained ones go per layer, on every chunk (a chunk that trains all
    # it holds too: its job's other chunks do not).
    partial = trains_part(model)
    if all(p.requires_grad for p in params) and not partial:
        return state
    trained = {id(p) for p in params if p.requires_grad}
    # Frozen layers' extra states (None for Megatron's local linears) go with them.
    return {key: _per_layer(value) if partial else value
            for key, value in state.items() if id(getattr(value, "data", None)) in trained}


def _per_layer(item: object) -> object:
    """A ShardedTensor (or the factory that builds them) of one layer of Megatron's stacked
    ``decoder.layers.*`` tensors as a tensor of that layer alone, keyed by its model-wide
    number (``decoder.layers.3.mlp...``): a checkpoint of only the trained layers then covers
    every tensor it holds, and reshards over TP and PP as the stacked one does."""
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        build = item.build_fn
        return dataclasses.replace(
            item, build_fn=lambda *args, **kwargs: _per_layer(build(*args, **kwargs)))
    if isinstance(item, (list, tuple)):
        return type(item)(_per_layer(x) for x in item)
    if isinstance(item, dict):
        return {k: _per_layer(v) for k, v in item.items()}
    if not isinstance(item, ShardedTensor) or not item.prepend_axis_num \
            or "decoder.layers." not in item.key:
        return item
    layer = item.global_offset[0]
    head, tail = item.key.split("decoder.layers.", 1)
    return dataclasses.replace(
        item, key=f"{head}decoder.layers.{layer}.{tail}", global_shape=item.global_shape[1:],
        global_offset=item.global_offset[1:], axis_fragmentations=item.axis_fragmentations[1:],
        prepend_axis_num=item.prepend_axis_num - 1)


def load_model(model: torch.nn.Module, loaded: dict[str, Any]) -> None:
    """Put a loaded model state back; only frozen parameters (and their layers' extra states)
    may be missing from it (see :func:`_trained_only`), anything else is an error."""
    from hpc_mca.models.freeze import trains_part

    missing, unexpected = model.load_state_dict(loaded, strict=False)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    if frozen or trains_part(model):
        frozen |= {key for key in missing if key.endswith("._extra_state")}
    wrong = [f"missing {key}" for key in missing if key not in frozen]
    wrong += [f"unexpected {key}" for key in unexpected]
    if wrong:
        raise RuntimeError(f"the checkpoint's model state does not fit this model: "
                           f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")


def build_state(loop: Resumable, *, loading: bool, with_rng: bool, config: dict[str, Any] | None,
                optimizer_format: str, model_only: bool = False) -> dict[str, Any]:
    """The sharded state dict of ``loop``; ``model_only`` (training.save_only_model) leaves
    out the optimizer and the LR scheduler (such a checkpoint is never resumed from).

    For loading, the same structure serves as the template that says which shards this rank
    needs; the optimizer allocates its state for it.
    """
    metadata = sharded_metadata(optimizer_format)
    if loading:
        init_optimizer_state(loop.optimizer)
    state = model_state(loop.model, metadata)
    own = loop.state_dict()
    if not model_only:
        if optimizer_format == model_space.FORMAT:
            state["optimizer"] = _model_space_state(loop.optimizer, state)
        else:
            state["optimizer"] = loop.optimizer.sharded_state_dict(
                state, is_loading=loading, metadata=metadata)
        state["lr_scheduler"] = own["lr_scheduler"]
    state["trainer"] = loop.counters.state_dict()
    if config is not None:
        state["config"] = config
    if with_rng:
        state["rng_state"] = rng_object(own["rng_state"])
    return state


def loop_state(loaded: dict[str, Any], with_rng: bool) -> LoopState:
    """The loop's part of a loaded checkpoint beside its counters, for
    ``Resumable.load_state_dict``."""
    state: LoopState = {"lr_scheduler": loaded["lr_scheduler"]}
    if with_rng:
        state["rng_state"] = loaded["rng_state"]
    return state


def _model_space_state(optimizer: MegatronOptimizer, models: dict[str, Any]) -> dict[str, Any]:
    """The optimizer entry in the model_space format: the common state of each distributed
    optimizer (param groups with the step, grad scaler) and their boxes (see .model_space).

    The boxes are named after model parameters, not after the optimizer that holds them, so
    the number of distributed optimizers may change on resume (MoE: one for dense and one for
    expert parameters when EP > 1, a single one at EP = 1): see :func:`_load_model_space`.
    """
    subs = _sub_optimizers(optimizer)
    return {"common": [sub.state_dict() for sub in subs],
            "param_state": {str(i): model_space.param_state(sub, models)
                            for i, sub in enumerate(subs)},
            "param_state_sharding_type": model_space.FORMAT}


# --- RNG -------------------------------------------------------------------------------------


def rng_object(states: dict[str, Any]) -> Any:
    """This rank's RNG ``states`` as a ShardedObject: one entry per global rank, each saved by
    its own rank (Megatron's own rng_state keeps only DP rank 0's)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", states, (dist.get_world_size(),),
                         (dist.get_rank(),), replica_id=0)


# --- the optimizer ---------------------------------------------------------------------------


def _sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def init_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Allocate the state of a fresh optimizer so a load has a template to fill.

    Megatron's ``init_state_fn`` for Adam creates exp_avg/exp_avg_sq but not torch Adam's
    ``step``, which DistributedOptimizer.state_dict() then reads from every parameter
    (KeyError('step') / an assert on a fresh optimizer): give each a step of 0, replaced by
    the checkpoint's own step when it is loaded.
    """
    for sub in _sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is None or getattr(sub, "init_state_fn", None) is None:
            continue
        sub.init_state_fn(inner, sub.config)
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if state and "step" not in state:
                    state["step"] = torch.tensor(0.0)


def load_optimizer(optimizer: MegatronOptimizer, loaded: dict[str, Any] | list[dict[str, Any]],
                   models: dict[str, Any] | None = None) -> None:
    """Put a loaded optimizer state back (see the module docstring for the ``step`` handling).
    ``loaded``: one optimizer's state, or one per optimizer of a chained one. ``models``: a
    fresh model sharded state dict (:func:`model_state`), which the model_space format needs
    to place its boxes."""
    subs = _sub_optimizers(optimizer)
    if isinstance(loaded, dict) and loaded.get("param_state_sharding_type") == model_space.FORMAT:
        _load_model_space(subs, loaded, models)
    else:
        _load_megatron_format(subs, loaded)
    if len(subs) > 1 and hasattr(optimizer, "_synchronize_steps"):
        optimizer._synchronize_steps()


def _load_model_space(subs: list[MegatronOptimizer], loaded: dict[str, Any], models: dict[str, Any] | None) -> None:
    """Every saved param group goes to every optimizer (Megatron picks each current group's
    saved counterpart by its identifying keys, is_expert_parallel among them), then each
    optimizer's boxes are copied in."""
    if models is None:
        raise ValueError(f"optimizer format {model_space.FORMAT}: load_optimizer needs the model's "
                         "sharded state dict (models=) to place the boxes")
    common = loaded["common"]
    groups = [group for part in common for group in part["optimizer"]["param_groups"]]
    merged = {**common[0], "optimizer": {**common[0]["optimizer"], "param_groups": groups}}
    for i, sub in enumerate(subs):
        sub.load_state_dict(merged)  # param groups; sets every param's step from them
        with _step_set_aside(sub.optimizer), torch.no_grad():
            model_space.load_param_state(sub, loaded["param_state"][str(i)], models)


def _load_megatron_format(subs: list[MegatronOptimizer], loaded: dict[str, Any] | list[dict[str, Any]]) -> None:
    """A plain optimizer, or Megatron's fully/dp_reshardable: one part per optimizer."""
    if isinstance(loaded, list):
        parts = list(loaded)
    elif len(subs) == 1:
        parts = [loaded]
    else:
        parts = [loaded[k] for k in sorted(loaded)]
    if len(parts) != len(subs):
        raise RuntimeError(f"the checkpoint has {len(parts)} optimizer(s), this run "
                           f"{len(subs)}")
    for sub, part in zip(subs, parts):
        _load_one(sub, part)


def _load_one(optimizer: MegatronOptimizer, state: dict[str, Any]) -> None:
    sharding = state.get("param_state_sharding_type")
    if sharding not in RESHARDABLE_FORMATS:
        optimizer.load_state_dict(state)  # plain optimizer: Megatron restores its common step
        return
    param_state = state.pop("param_state")
    state.pop("param_state_sharding_type")
    optimizer.load_state_dict(state)  # param groups; sets every param's step from them
    # no_grad: the dp_reshardable loader copies into main params without it (in-place on a
    # view of a leaf that requires grad).
    with _step_set_aside(optimizer.optimizer), torch.no_grad():
        if sharding == "fully_reshardable":
            optimizer.load_parameter_state_from_fully_reshardable(param_state)
        else:
            optimizer.load_parameter_state_from_dp_reshardable(param_state)


@contextlib.contextmanager
def _step_set_aside(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Hide torch Adam's per-param ``step`` (not part of the fully_reshardable parameter
    state) while Megatron copies that state in; put back one tensor PER parameter.

    DistributedOptimizer.load_state_dict assigns one step tensor to every parameter, and
    torch's load_state_dict keeps it shared; torch AdamW then increments it in place once per
    parameter per step, so the bias correction of every later step would be wrong.
    """
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    try:
        yield
    finally:
        for param, step in steps.items():
            inner.state[param]["step"] = step.detach().clone()


def optimizer_step(optimizer: MegatronOptimizer) -> float | None:
    """The inner optimizer's step count (the same for every parameter), for checks."""
    for sub in _sub_optimizers(optimizer):
        for state in sub.optimizer.state.values():
            if "step" in state:
                return float(state["step"])
    return None
