"""``AutoModel``: the Megatron-Core model of a run's layout, from an HF directory or config.

    model = AutoModel.from_pretrained("path/to/hf_model", args)   # weights imported, if any
    model = AutoModel.from_config(model.config, args)             # the seeded random init

Either opens this rank's session first (:func:`hpc_mca.api.session.open_session`: the input
checks, then torch.distributed and Megatron's groups for ``args``' layout), then builds this
rank's chunks (one per virtual pipeline stage) as ``hpc-mca train`` does, and applies the
finetuning type (LoRA adapters on the frozen model, freeze, adapters given as input) before
anything wraps them. :meth:`McaModel.save_pretrained` writes what the finetuning type exports:
the HF model, or the PEFT adapter under LoRA (``merged=True``: the merged HF model).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError
from hpc_mca.models.converters import converter_for
from hpc_mca.models.weights import unwrap
from hpc_mca.trainer.megatron_settings import model_overrides, torch_dtype

from .arguments import TrainingArguments
from .session import Session, open_session

__all__ = ["AutoModel", "McaModel"]


class McaModel(torch.nn.Module):
    """This rank's share of a Megatron-Core GPT model: ``chunks`` (one per virtual pipeline
    stage), the HF ``config`` it was built from, and the run config it was built for."""

    def __init__(self, chunks: list[torch.nn.Module], *, config: Any, source: str | Mapping[str, Any],
                 session: Session, builder: Any) -> None:
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self.config = config
        """transformers' config of the model (``PretrainedConfig``)."""
        self.name_or_path = source if isinstance(source, str) else None
        self.source = source
        self.session = session
        self._builder = builder  # (source, load_weights) -> chunks in the same layout

    @property
    def run_config(self) -> TrainConfig:
        return self.session.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first chunk's forward (the whole model without pipeline parallelism); training
        runs the chunks through Megatron's schedules (:class:`~hpc_mca.api.McaTrainer`)."""
        return self.chunks[0](*args, **kwargs)

    def build_like(self, source: str | Path | Mapping[str, Any] | None = None,
                   load_weights: bool | None = None) -> list[torch.nn.Module]:
        """Chunks of another model in this one's layout (``source`` default: this model's)."""
        return self._builder(self.source if source is None else source, load_weights=load_weights)

    def save_pretrained(self, out_dir: str | Path, merged: bool = False) -> None:
        """Write what the finetuning type exports to ``out_dir`` (every rank calls it: each
        sends its shards; rank 0 writes)."""
        chunks = [unwrap(chunk) for chunk in self.chunks]
        converter = converter_for(self.run_config.finetuning, self.run_config.model.adapter_name_or_path)
        converter.export_chunks(chunks, Path(out_dir), model_path=self.source, merged=merged)  # type: ignore[arg-type]


class AutoModel:
    """Builds :class:`McaModel` (transformers' ``AutoModel`` names, Megatron-Core models)."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | Path, args: TrainingArguments) -> McaModel:
        """The model of an HF directory (``config.json``; ``*.safetensors`` weights when there
        are any, else the seeded random init) in ``args``' layout. ``args.model_name_or_path``
        (the run's model: its tokenizer, the planner's shape) is set to the directory when
        empty; another directory builds another model for the run, e.g. dpo's reference."""
        path = str(model_name_or_path)
        if not args.model_name_or_path:
            args.model_name_or_path = path
        return pretrained_model(_session(args), path)

    @classmethod
    def from_config(cls, config: Any, args: TrainingArguments) -> McaModel:
        """A model of ``config`` (transformers' config, a dict, or a directory's config.json)
        with the seeded random init, in ``args``' layout; ``args.model_name_or_path`` still
        names the run's model directory (its tokenizer, the planner's shape)."""
        session = _session(args)
        source = config.to_dict() if hasattr(config, "to_dict") else config
        return _built(session, source if isinstance(source, Mapping) else str(source), False)


def pretrained_model(session: Session, path: str) -> McaModel:
    """:meth:`AutoModel.from_pretrained` in an open session (``hpc-mca train``'s way in)."""
    return _built(session, path, any(Path(path).glob("*.safetensors")))


def _session(args: TrainingArguments) -> Session:
    from hpc_mca.runtime.env import from_environ

    env = from_environ()
    try:
        config = args.resolve(env.world_size)
    except UserError as err:
        err.on_every_rank = True  # every rank has the same arguments
        raise
    return open_session(config, env)


def _built(session: Session, source: str | Mapping[str, Any], load_weights: bool) -> McaModel:
    from hpc_mca.models.build import build_model

    config, ctx = session.config, session.ctx
    build = functools.partial(
        _build, build_model, ctx, seq_length=config.data.seq_length or config.data.cutoff_len,
        attention_backend=config.model.attention_backend, packed_attention=config.model.packed_attention,
        dtype=torch_dtype(config.training),
        config_overrides=model_overrides(config.model, config.parallel, config.training),
        compile_layers="layer" in config.model.fusions)
    chunks = build(source, load_weights=load_weights)
    # What the finetuning type trains (LoRA adapters on a frozen base...), before anything wraps them.
    chunks = converter_for(config.finetuning, config.model.adapter_name_or_path).convert_chunks(
        chunks, model_path=config.model.model_name_or_path, seed=config.training.seed)
    return McaModel(chunks, config=_hf_config(source), source=source, session=session, builder=build)


def _build(build_model: Any, ctx: Any, source: Any, *, load_weights: bool | None, **kwargs: Any) -> Any:
    if load_weights is None:
        load_weights = not isinstance(source, Mapping) and any(Path(source).glob("*.safetensors"))
    return build_model(source, ctx, load_weights=load_weights, **kwargs)


def _hf_config(source: str | Mapping[str, Any]) -> Any:
    from transformers import AutoConfig

    if isinstance(source, Mapping):
        values = dict(source)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    return AutoConfig.from_pretrained(source)
