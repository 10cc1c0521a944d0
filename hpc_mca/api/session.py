"""This rank's training session: the checks before the process group, then the process group.

Failing well needs an order: everything that can be checked without the network or memory
(config rules, dataset files, the tokenizer against the model, the attention kernels this
machine has, Megatron's own config objects, the checkpoint to resume) is checked before any
collective, so a bad input makes every rank stop alone with the same one-line message
(:attr:`hpc_mca.errors.UserError.on_every_rank`). :func:`check_inputs` is that list; both
``hpc-mca train`` and the Python API run it. :func:`open_session` then brings up
torch.distributed and Megatron's groups once per process (``AutoModel`` calls it; a second
model of the same layout reuses them) and tears them down at exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_mca.checkpoint.afresh import start_afresh
from hpc_mca.checkpoint.compat import resume_check
from hpc_mca.config.layout import layout_of
from hpc_mca.config.sections import DataArguments, ModelArguments, TrainConfig, TrainingArguments
from hpc_mca.errors import UserError
from hpc_mca.runtime.distributed import RankContext, init_distributed, shutdown
from hpc_mca.runtime.env import RankEnv, from_environ
from hpc_mca.topology import LayoutError, ModelShape
from hpc_mca.trainer.megatron_settings import check_megatron_settings, default_fusions, torch_dtype


@dataclass
class Session:
    """The process group this process trains in, and the config it was opened for."""

    config: TrainConfig
    ctx: RankContext


_SESSION: Session | None = None


def open_session(config: TrainConfig, env: RankEnv | None = None, *, checked: bool = False) -> Session:
    """Check ``config``'s inputs (:func:`check_inputs`; ``checked``: the caller did) and bring
    up the process group for its layout, once per process: a config of the same layout gets
    the open session (with its own config); another layout is bad input (Megatron's groups
    exist once per process)."""
    global _SESSION
    env = env or from_environ()
    if not checked:
        config = check_inputs(config, env)
    if _SESSION is not None:
        if layout_of(_SESSION.config.parallel) != layout_of(config.parallel):
            err = LayoutError([f"this process already trains with {layout_of(_SESSION.config.parallel)}; "
                               f"valid: every model and trainer of a process in the same layout"])
            err.on_every_rank = True
            raise err
        return Session(config, _SESSION.ctx)
    try:
        ctx = init_distributed(layout_of(config.parallel), model=model_shape(config.model), seed=config.training.seed,
                               env=env, global_batch_size=config.training.global_batch_size,
                               micro_batch_size=config.training.per_device_train_batch_size,
                               timeout_s=config.training.ddp_timeout)
    except UserError as err:  # a layout or ranks-per-GPU refusal: found alike by every rank
        err.on_every_rank = True
        raise
    _SESSION = Session(config, ctx)
    atexit.register(close_session)
    return _SESSION


def close_session() -> None:
    """Tear the process group down (safe to call twice; also at interpreter exit)."""
    global _SESSION
    if _SESSION is not None:
        _SESSION = None
        shutdown()


def check_inputs(config: TrainConfig, env: RankEnv) -> TrainConfig:
    """The checks every rank makes alike before any collective; a UserError raised here is
    marked as found by every rank. Returns the config this rank trains with: ``config`` (as
    resolved) with the choices made here (the fusions, a resume skipped after a fresh start)."""
    try:
        if config.data.dataset or config.data.data_path is not None:
            data_files_exist(config.data)
        tokenizer_fits_model(config, _shape_of(config.model.model_name_or_path).vocab_size)
        if config.model.fusions is None:
            config = config.amended("model", fusions=choose_fusions(config))
        if config.training.use_mca:
            attention_backend_available(config)
            check_megatron_settings(config, layout_of(config.parallel))
        if start_afresh_if_asked(config.training, env):  # before anything reads output_dir
            config = config.amended("training", resume_from_checkpoint="never")
        resume_check(config, env.world_size, model_shape(config.model))  # before any collective
    except UserError as err:
        err.on_every_rank = True  # every rank read the same inputs and stops here alike
        raise
    return config


def choose_fusions(config: TrainConfig) -> list[str]:
    """The fusions for a config that names none (``model.fusions`` unset): what this rank's
    machine runs fastest (:func:`default_fusions`); the run's saved config names what ran."""
    from hpc_mca.models.attention_backend import select_attention_backend

    backend = select_attention_backend(config.model.attention_backend) if config.training.use_mca else ""
    return default_fusions(config, cuda=torch.cuda.is_available(), backend=backend,
                           moe=model_shape(config.model).is_moe)


def start_afresh_if_asked(training: TrainingArguments, env: RankEnv) -> bool:
    """``training.overwrite_output_dir``: on a run's first start, an output_dir holding an
    older run is moved aside by global rank 0 and this run resumes nothing (see
    :mod:`hpc_mca.checkpoint.afresh`); a requeue or continuation of the run leaves it.
    True when the run must then resume nothing (``resume_from_checkpoint`` becomes never)."""
    if not training.overwrite_output_dir:
        return False
    # torchrun's own restarts (--max-restarts) re-run the same command as a Slurm requeue does.
    restarts = env.restart_count or int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    moved = start_afresh(Path(training.output_dir), job_id=env.job_id, restart_count=restarts,
                         is_main=env.rank == 0)
    if moved is None:
        return False
    if env.rank == 0:
        print(f"training.overwrite_output_dir: the earlier run in {training.output_dir} was "
              f"moved to {moved}; this run starts afresh", flush=True)
    # every rank, whichever looks before the rename: an explicit checkpoint path still applies
    return training.resume_from_checkpoint in ("", "auto")


def data_files_exist(data: DataArguments) -> None:
    from hpc_mca.data.sources import check_sources

    check_sources(data)  # paths, or dataset_info.json names and their files


def tokenizer_fits_model(config: TrainConfig, vocab_size: int) -> None:
    """A tokenizer with more tokens than the model has embeddings - as loaded, or once
    ``data.template`` added its special tokens (as LLaMA-Factory's templates add them) - is
    refused before the process group, whatever the data happens to use, unless
    ``model.resize_vocab`` grows the model to it: then the grown size is recorded for the
    model directory (:func:`hpc_mca.models.vocab_growth.record_vocab_growth`), which the build,
    the import, the checkpoint's records and the export read. The data's own ids are checked
    again when it is read (hpc_mca.data.store.check_token_ids)."""
    from hpc_mca.data.tokenize import load_tokenizer
    from hpc_mca.models.errors import ModelLoadError
    from hpc_mca.models.vocab import grown_size
    from hpc_mca.models.vocab_growth import VocabGrowth, record_vocab_growth

    model = config.model
    path = model.tokenizer_name_or_path or model.model_name_or_path
    record_vocab_growth(model.model_name_or_path, None)  # a process's earlier run recorded its own
    tokenizer = load_tokenizer(path)
    size = len(tokenizer)
    if size > vocab_size and not model.resize_vocab:
        raise ModelLoadError(f"the tokenizer at {path} has {size} tokens but the model's "
                             f"vocab_size is {vocab_size} (ids from {vocab_size} on have no "
                             f"embedding); valid: the model's own tokenizer, of at most "
                             f"{vocab_size} tokens (model.tokenizer_name_or_path), or "
                             "model.resize_vocab: true to grow the model")
    if config.data.dataset or config.data.data_path is not None:  # the pipeline fixes the tokenizer
        from hpc_mca.data.dataset import fix_tokenizer

        fix_tokenizer(tokenizer, config.data, config.finetuning.stage)
    if len(tokenizer) > vocab_size and not model.resize_vocab:
        token = tokenizer.convert_ids_to_tokens(vocab_size)
        raise ModelLoadError(f"data.template={config.data.template!r} adds the token {token!r} to the "
                             f"tokenizer at {path} (id {vocab_size}, {len(tokenizer)} tokens in all), "
                             f"past the model's vocab_size {vocab_size}; valid: model.resize_vocab: true "
                             "(grow the embeddings for the added tokens, as LLaMA-Factory's resize_vocab), "
                             "or a template whose special tokens the tokenizer has")
    grown = grown_size(len(tokenizer), vocab_size)
    if grown > vocab_size:
        record_vocab_growth(model.model_name_or_path,
                            VocabGrowth(grown, config.training.seed, tokenizer))


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
    spec = read_hf_config(config.model.model_name_or_path)
    kernel, why = packed_kernel(spec, backend, config.model.packed_attention,
                                cuda=torch.cuda.is_available(), dtype=torch_dtype(config.training),
                                cp=par.context_parallel_size)
    packed = f"packed kernel {kernel}" if kernel else "packed sequences"
    fusions = config.model.fusions or ()  # None until choose_fusions
    layers = "; decoder layers: torch.compile" if "layer" in fusions else ""
    rope = ("multi-latent attention's own, unfused" if spec.mla is not None
            else describe("rope" in fusions))
    return f"attention: {backend} backend, {packed} ({why}); RoPE: {rope}{layers}"


@functools.cache
def _shape_of(model_dir: str) -> ModelShape:
    return ModelShape.from_hf_config(model_dir)


def model_shape(model: ModelArguments) -> ModelShape:
    """The planner's shape of the config's model (read once per directory), with the
    vocabulary ``model.resize_vocab`` grew it to (recorded by :func:`check_inputs`)."""
    from hpc_mca.models.vocab_growth import vocab_growth

    shape = _shape_of(model.model_name_or_path)
    growth = vocab_growth(model.model_name_or_path) if model.resize_vocab else None
    return shape if growth is None else dataclasses.replace(shape, vocab_size=growth.size)
