"""``hpc-mca train``: from a YAML config to a trained model, on every rank.

Order matters for failing well: everything that can be checked without the network or memory
(config, layout, dataset files, model config vs weights) is checked before the process group
comes up, so a bad input makes every rank exit alone with the same one-line message.
"""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from hpc_mca.checkpoint.afresh import start_afresh
from hpc_mca.checkpoint.compat import nothing_to_train, resume_check
from hpc_mca.config.layout import layout_of
from hpc_mca.config.sections import DataArguments, ModelArguments, TrainConfig, TrainingArguments, load_resolved
from hpc_mca.errors import UserError
from hpc_mca.loop.trackers import skip_unused_tracker_imports
from hpc_mca.rundir import clear_bad_input
from hpc_mca.runtime.distributed import (
    RankContext,
    describe_process_group,
    init_distributed,
    rank_zero_first,
    shutdown,
)
from hpc_mca.runtime.env import RankEnv, from_environ
from hpc_mca.runtime.quiet import library_line
from hpc_mca.topology import ModelShape
from hpc_mca.trainer.megatron_settings import check_megatron_settings, model_overrides, torch_dtype


def run_training(config_path: str | Path | None, overrides: Iterable[str] = (),
                 callbacks: Iterable[Any] = ()) -> list[Any]:
    """Train as configured; return the per-step results (identical on every rank)."""
    env = from_environ()
    try:
        config = load_resolved(config_path, overrides, env.world_size)
        data_files_exist(config.data)
        tokenizer_fits_model(config.model, _shape(config.model).vocab_size)
        if config.training.use_mca:
            attention_backend_available(config)
            check_megatron_settings(config, layout_of(config.parallel))
        start_afresh_if_asked(config.training, env)  # before anything reads output_dir
        resume_check(config, env.world_size, _shape(config.model))  # before any collective
    except UserError as err:
        err.on_every_rank = True  # every rank read the same inputs and stops here alike
        raise
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

        return run_standard(config, env, _shape(config.model), callbacks)
    try:
        ctx = init_distributed(layout_of(config.parallel), model=_shape(config.model), seed=config.training.seed,
                               env=env, global_batch_size=config.training.global_batch_size,
                               micro_batch_size=config.training.per_device_train_batch_size,
                               timeout_s=config.training.ddp_timeout)
    except UserError as err:  # a layout or ranks-per-GPU refusal: found alike by every rank
        err.on_every_rank = True
        raise
    try:
        return _train(config, ctx, callbacks)
    finally:
        shutdown()


def _train(config: TrainConfig, ctx: RankContext, callbacks: Iterable[Any]) -> list[Any]:
    from hpc_mca.models.build import build_model
    from hpc_mca.models.converters import converter_for
    from hpc_mca.trainer.stages import objective_for
    from hpc_mca.trainer.trainer import Trainer

    run_dir = Path(config.training.output_dir)
    if ctx.is_main:
        config.save_resolved(run_dir)
        clear_bad_input(run_dir)  # this run's inputs got it this far
    objective = objective_for(config, ctx, _shape(config.model).vocab_size)
    data = _datasets(objective, ctx)
    if ctx.is_main:
        print(data.describe(), flush=True)
        print(library_line(), flush=True)
        print(describe_process_group(), flush=True)
        print(attention_backend_available(config), flush=True)
    model_dir = Path(config.model.model_name_or_path)
    # A directory with only config.json (the demo's) trains from a random init.
    has_weights = any(model_dir.glob("*.safetensors"))
    # build(): the policy's chunks; build(dir, load_weights=...) another model of the same
    # shape in the same layout (dpo's finetuning.ref_model).
    build = functools.partial(_build_from, build_model, model_dir, has_weights, ctx,
                              seq_length=_seq_length(config.data),
                              attention_backend=config.model.attention_backend,
                              packed_attention=config.model.packed_attention,
                              dtype=torch_dtype(config.training),
                              config_overrides=model_overrides(config.model, config.parallel,
                                                               config.training),
                              compile_layers="layer" in config.model.fusions)
    # What the finetuning type trains (LoRA adapters on a frozen base…): before DDP wraps them.
    chunks = converter_for(config.finetuning, config.model.adapter_name_or_path).convert_chunks(
        build(), model_path=config.model.model_name_or_path, seed=config.training.seed)
    objective.attach(chunks, build)  # dpo's reference: a frozen copy of the starting model
    shape = _shape(config.model)
    trainer = Trainer(config, ctx, chunks, data, objective=objective, run_dir=run_dir,
                      model_shape=shape, callbacks=callbacks)
    # What exists now (imports, model, optimizer, data index) lives to the end of the run: keep
    # it out of the cyclic collector's scans. Megatron calls gc.collect() around checkpoint
    # state dicts, and each full collection over these objects took 0.17 s of a 0.5 s save.
    # Unfrozen at the end, so that interpreter shutdown still collects them (triton's nanobind
    # bindings report objects left uncollected at exit as leaks, on stderr).
    gc.collect()
    gc.freeze()
    try:
        # Resume, interval/end/on-signal saves, the finished marker: the trainer's checkpointer.
        return trainer.train()
    finally:
        gc.unfreeze()


def _build_from(build_model: Any, model_dir: Path, has_weights: bool, ctx: RankContext, *args: Any,
                load_weights: bool | None = None, **kwargs: Any) -> Any:
    """``build_model`` of ``args[0]`` (default: the policy's ``model_dir``), loading weights when
    ``load_weights`` (default: whether the policy's directory has them)."""
    source = args[0] if args else model_dir
    weights = has_weights if load_weights is None else load_weights
    return build_model(source, ctx, load_weights=weights, **kwargs)


def _datasets(objective: Any, ctx: RankContext) -> Any:
    """Rank 0 tokenizes and fills the cache; the others wait and read it (bad data stops
    every rank: see rank_zero_first). Eval rows too few for one evaluation step are bad data
    too, found here rather than at the first evaluation."""
    from hpc_mca.data.dataset import check_eval_rows

    def build() -> Any:
        data = objective.build_data()
        check_eval_rows(data.eval, objective.config.data_run())
        return data

    return rank_zero_first(build, ctx.is_main)


def start_afresh_if_asked(training: TrainingArguments, env: RankEnv) -> None:
    """``training.overwrite_output_dir``: on a run's first start, an output_dir holding an
    older run is moved aside by global rank 0 and this run resumes nothing (see
    :mod:`hpc_mca.checkpoint.afresh`); a requeue or continuation of the run leaves it."""
    if not training.overwrite_output_dir:
        return
    # torchrun's own restarts (--max-restarts) re-run the same command as a Slurm requeue does.
    restarts = env.restart_count or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    moved = start_afresh(Path(training.output_dir), job_id=env.job_id, restart_count=restarts,
                         is_main=env.rank == 0)
    if moved is None:
        return
    if training.resume_from_checkpoint in ("", "auto"):
        training.resume_from_checkpoint = "never"  # whichever rank looks before the rename
    if env.rank == 0:
        print(f"training.overwrite_output_dir: the earlier run in {training.output_dir} was "
              f"moved to {moved}; this run starts afresh", flush=True)


def data_files_exist(data: DataArguments) -> None:
    from hpc_mca.data.sources import check_sources

    check_sources(data)  # paths, or dataset_info.json names and their files


def tokenizer_fits_model(model: ModelArguments, vocab_size: int) -> None:
    """A tokenizer with more tokens than the model has embeddings is the wrong tokenizer (or
    the wrong model): refused before the process group, whatever the data happens to use. The
    data's own ids are checked again when it is read (hpc_mca.data.store.check_token_ids)."""
    from hpc_mca.data.tokenize import load_tokenizer
    from hpc_mca.models.errors import ModelLoadError

    path = model.tokenizer_name_or_path or model.model_name_or_path
    size = len(load_tokenizer(path))
    if size > vocab_size:
        raise ModelLoadError(f"the tokenizer at {path} has {size} tokens but the model's "
                             f"vocab_size is {vocab_size} (ids from {vocab_size} on have no "
                             f"embedding); valid: the model's own tokenizer, of at most "
                             f"{vocab_size} tokens (model.tokenizer_name_or_path)")


def attention_backend_available(config: TrainConfig) -> str:
    """An explicit ``model.attention_backend`` this machine lacks (``te`` without Transformer
    Engine or CUDA), context parallelism the backend it gets cannot run (flash; p2p without
    TE), or a ``model.packed_attention`` kernel it cannot train with is bad input, refused
    before the process group like a config error. Returns the line that says what runs."""
    from hpc_mca.models.attention_backend import check_context_parallel, select_attention_backend
    from hpc_mca.models.build import packed_kernel
    from hpc_mca.models.hf_config import read_hf_config
    from hpc_mca.models.rope import describe

    par = config.parallel
    backend = select_attention_backend(config.model.attention_backend)
    check_context_parallel(backend, par.context_parallel_size, par.cp_comm_type)
    kernel, why = packed_kernel(read_hf_config(config.model.model_name_or_path), backend,
                                config.model.packed_attention, cuda=torch.cuda.is_available(),
                                dtype=torch_dtype(config.training), cp=par.context_parallel_size)
    packed = f"packed kernel {kernel}" if kernel else "packed sequences"
    layers = "; decoder layers: torch.compile" if "layer" in config.model.fusions else ""
    return (f"attention: {backend} backend, {packed} ({why}); "
            f"RoPE: {describe('rope' in config.model.fusions)}{layers}")


@functools.cache
def _shape_of(model_dir: str) -> ModelShape:
    return ModelShape.from_hf_config(model_dir)


def _shape(model: ModelArguments) -> ModelShape:
    return _shape_of(model.model_name_or_path)


def _seq_length(data: DataArguments) -> int:
    return data.seq_length or data.cutoff_len
