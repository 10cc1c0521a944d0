"""``hpc-mca train``: from a YAML config to a trained model, on every rank.

The config is read and checked whole first (every problem in one message), then the inputs
every rank can check alike before any collective (:func:`hpc_mca.api.session.check_inputs`),
so a bad input makes every rank exit alone with the same one-line message. Then the backend
the config names trains: the Megatron-Core backend through the Python API (``AutoModel``,
``McaTrainer``: a YAML run is a script with the datasets its config names, so the two cannot
drift), the standard backend (``training.use_mca: false``) through :mod:`hpc_mca.standard`.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Iterable

from hpc_mca.api.session import (
    attention_backend_available,
    check_inputs,
    close_session,
    data_files_exist,
    model_shape,
    start_afresh_if_asked,
    tokenizer_fits_model,
)
from hpc_mca.checkpoint.compat import nothing_to_train
from hpc_mca.config.loading import load_resolved
from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError
from hpc_mca.loop.trackers import skip_unused_tracker_imports
from hpc_mca.runtime import heartbeat
from hpc_mca.runtime.env import from_environ

__all__ = ["attention_backend_available", "data_files_exist", "run_training", "start_afresh_if_asked",
           "tokenizer_fits_model"]
"""``run_training``, and the pre-process-group checks under the names callers import from here."""


def run_training(config_path: str | Path | None, overrides: Iterable[str] = (),
                 callbacks: Iterable[Any] = ()) -> list[Any]:
    """Train as configured; return the per-step results (identical on every rank)."""
    env = from_environ()
    try:
        config = load_resolved(config_path, overrides, env.world_size)
    except UserError as err:
        err.on_every_rank = True  # every rank read the same file
        raise
    heartbeat.configure_process(config.training.hang_timeout, config.training.ddp_timeout)
    config = check_inputs(config, env)
    skip_unused_tracker_imports(config.training.report_to)  # before megatron is imported
    if config.training.profile_steps:
        from hpc_mca.loop.profiling import ProfilerCallback

        callbacks = [*callbacks, ProfilerCallback(*config.training.profile_steps)]
    idle = nothing_to_train(config.training)  # a finished run started again: no need for any rank
    if idle is not None:
        if env.rank == 0:
            print(idle, flush=True)
        return []
    if not config.training.use_mca:
        from hpc_mca.standard.run import run_standard

        return run_standard(config, env, model_shape(config.model), callbacks)
    try:
        return _train(config, callbacks)
    finally:
        close_session()


def _train(config: TrainConfig, callbacks: Iterable[Any]) -> list[Any]:
    from hpc_mca.api import McaTrainer
    from hpc_mca.api.model import pretrained_model
    from hpc_mca.api.session import open_session

    # The config as read (no script environment applies: the batch script passed the run dir
    # and the plan as overrides), its inputs checked above.
    session = open_session(config, checked=True)
    model = pretrained_model(session, config.model.model_name_or_path)
    trainer = McaTrainer(model, callbacks=callbacks, config=config)
    # What exists now (imports, model, optimizer, data index) lives to the end of the run: keep
    # it out of the cyclic collector's scans. Megatron calls gc.collect() around checkpoint
    # state dicts, and each full collection over these objects took 0.17 s of a 0.5 s save.
    # Unfrozen at the end, so that interpreter shutdown still collects them (triton's nanobind
    # bindings report objects left uncollected at exit as leaks, on stderr).
    gc.collect()
    gc.freeze()
    try:
        # Resume, interval/end/on-signal saves, the finished marker: the trainer's checkpointer.
        return trainer.run()
    finally:
        gc.unfreeze()
