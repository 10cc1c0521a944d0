"""``AutoConfig`` and ``AutoModel``: the Megatron-Core model of a run's layout, as
mcore_adapter's ``hpc_mca.models`` names build it.

    model = AutoModel.from_pretrained("path/to/hf_model", training_args)  # weights, if any
    config = AutoConfig.from_pretrained("path/to/hf_model", training_args)
    reference = AutoModel.from_config(config)                             # the seeded init
    reference.load_state_dict(model.state_dict())

Either opens this rank's session first (:func:`hpc_mca.api.session.open_session`: the input
checks, then torch.distributed and Megatron's groups for the arguments' layout), then builds
this rank's chunks (one per virtual pipeline stage) as ``hpc-mca train`` does, and applies the
finetuning type of the arguments' run config (LoRA adapters on the frozen model, freeze,
adapters given as input) before anything wraps them. The model is a container of its chunks,
as ROLL's: ``model[0]``, ``model.models`` (a script may replace a chunk there, e.g. by peft's
``get_peft_model(model[0], LoraConfig(...))``: see :mod:`hpc_mca.adapters`), ``len(model)``.
:meth:`McaModel.save_pretrained` writes what the finetuning type exports: the HF model, or the
PEFT adapter under LoRA (``merged=True``: the merged HF model).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hpc_mca.config.sections import TrainConfig
from hpc_mca.errors import UserError
from hpc_mca.models.converters import converter_for
from hpc_mca.models.weights import unwrap
from hpc_mca.trainer.megatron_settings import model_overrides, torch_dtype

from .session import Session, open_session

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from hpc_mca.runtime.distributed import RankContext
    from hpc_mca.training_args import MegatronArguments

__all__ = ["AutoConfig", "AutoModel", "McaConfig", "McaModel"]


@dataclass
class McaConfig:
    """A model's HF config and the arguments it is built with (ROLL's ``McaModelConfig``: what
    ``AutoModel.from_config`` needs). Reads of any other attribute go to the HF config
    (``config.vocab_size``, ``config.num_hidden_layers``)."""

    hf_config: PretrainedConfig
    """transformers' config of the model."""
    args: MegatronArguments | None = None
    """The script's arguments the model is built with (its layout); None for a model built
    for an open session (``hpc-mca train``)."""
    name_or_path: str | None = None
    """The HF model directory it was read from (None: built from a config)."""

    @property
    def hf_model_type(self) -> str:
        """The HF ``model_type`` (``llama``, ``qwen3_moe``...), as ROLL's config names it."""
        return str(self.hf_config.model_type)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("hf_config", "args", "name_or_path"):
            raise AttributeError(name)
        return getattr(self.hf_config, name)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.hf_config.to_dict(), hf_model_type=self.hf_model_type)


class ChunkBuilder(Protocol):
    """Chunks of another model in a model's layout: of ``source`` (an HF directory, a
    config.json or a config dict), with its weights when ``load_weights`` (None: when the
    directory has any)."""

    def __call__(self, source: str | Path | Mapping[str, Any], *, load_weights: bool | None
                 ) -> list[torch.nn.Module]: ...


class McaModel(torch.nn.Module):
    """This rank's share of a Megatron-Core GPT model: ``models`` (its chunks, one per virtual
    pipeline stage), the :class:`McaConfig` it was built from, and the run config it was built
    for."""

    def __init__(self, chunks: list[torch.nn.Module], *, config: McaConfig, source: str | Mapping[str, Any],
                 session: Session, builder: ChunkBuilder) -> None:
        super().__init__()
        self.models = torch.nn.ModuleList(chunks)
        self.config = config
        self.name_or_path = source if isinstance(source, str) else None
        self.source = source
        self.session = session
        self._builder = builder

    @property
    def run_config(self) -> TrainConfig:
        return self.session.config

    def __getitem__(self, index: int) -> torch.nn.Module:
        return self.models[index]

    def __len__(self) -> int:
        return len(self.models)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self.models)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # Any: Megatron's GPTModel.forward, open and untyped
        """The first chunk's forward (the whole model without pipeline parallelism); training
        runs the chunks through Megatron's schedules (:class:`~hpc_mca.api.McaTrainer`)."""
        return self.models[0](*args, **kwargs)

    def build_like(self, source: str | Path | Mapping[str, Any] | None = None,
                   load_weights: bool | None = None) -> list[torch.nn.Module]:
        """Chunks of another model in this one's layout (``source`` default: this model's)."""
        return self._builder(self.source if source is None else source, load_weights=load_weights)

    def save_pretrained(self, out_dir: str | Path, merged: bool = False) -> None:
        """Write what the finetuning type exports to ``out_dir`` (every rank calls it: each
        sends its shards; rank 0 writes); a script's own peft LoRA exports as the PEFT adapter
        (:mod:`hpc_mca.models.lora_peft`)."""
        from hpc_mca.models.lora_peft import finetuning_from_peft, trained_chunks

        chunks = [unwrap(chunk) for chunk in trained_chunks(list(self.models))]
        finetuning = (finetuning_from_peft(list(self.models), self.run_config.finetuning)
                      or self.run_config.finetuning)
        converter = converter_for(finetuning, self.run_config.model.adapter_name_or_path)
        converter.export_chunks(chunks, Path(out_dir), model_path=self.run_config.model.model_name_or_path,
                                merged=merged)


class AutoConfig:
    """:class:`McaConfig` of an HF model directory for a script's arguments."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | Path, args: MegatronArguments) -> McaConfig:
        """The HF config of ``model_name_or_path`` (its config.json) with ``args``."""
        from transformers import AutoConfig as HFAutoConfig

        path = str(model_name_or_path)
        return McaConfig(HFAutoConfig.from_pretrained(path), args, path)


class AutoModel:
    """Builds :class:`McaModel` (transformers' ``AutoModel`` names, Megatron-Core models)."""

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | Path, args: MegatronArguments) -> McaModel:
        """The model of an HF directory (``config.json``; ``*.safetensors`` weights when there
        are any, else the seeded random init) in ``args``' layout. It is the run's model (its
        tokenizer, the planner's shape) unless the arguments' run config names another (a
        second model for the run, e.g. dpo's reference); ``args`` is not changed."""
        path = str(model_name_or_path)
        return pretrained_model(_session(args, path), path, args)

    @classmethod
    def from_config(cls, config: McaConfig | PretrainedConfig | Mapping[str, Any] | str,
                    args: MegatronArguments | None = None) -> McaModel:
        """A model of ``config`` with the seeded random init: an :class:`McaConfig` (built
        with its arguments), or transformers' config, a dict or a directory's config.json with
        ``args``. The run's model directory (its tokenizer, the planner's shape) is the
        arguments' own, else the one the config was read from."""
        if isinstance(config, McaConfig):
            args, path, config = args or config.args, config.name_or_path, config.hf_config
        else:
            path = config if isinstance(config, str) else None
        if args is None:
            raise TypeError("AutoModel.from_config needs the arguments: an AutoConfig.from_pretrained"
                            "(path, args) config, or from_config(config, args)")
        source = config.to_dict() if hasattr(config, "to_dict") else config
        session = _session(args, path)
        return _built(session, source if isinstance(source, Mapping) else str(source), False, args)


def pretrained_model(session: Session, path: str, args: MegatronArguments | None = None) -> McaModel:
    """:meth:`AutoModel.from_pretrained` in an open session (``hpc-mca train``'s way in)."""
    return _built(session, path, any(Path(path).glob("*.safetensors")), args)


def run_config_for(args: MegatronArguments, model_path: str | None) -> TrainConfig:
    """The run config of a script's arguments: their view (:meth:`MegatronArguments.to_config`)
    with ``model_path`` as the run's model when they name none."""
    config = args.to_config()
    if not config.model.model_name_or_path and model_path:
        config.model.model_name_or_path = model_path
    return config


def _session(args: MegatronArguments, model_path: str | None) -> Session:
    from hpc_mca.runtime.env import from_environ

    env = from_environ()
    try:
        config = run_config_for(args, model_path).resolve(env.world_size)
    except UserError as err:
        err.on_every_rank = True  # every rank has the same arguments
        raise
    return open_session(config, env)


def _built(session: Session, source: str | Mapping[str, Any], load_weights: bool,
           args: MegatronArguments | None) -> McaModel:
    from hpc_mca.models.lora_peft import mark_lora_sites

    config, ctx = session.config, session.ctx
    build = functools.partial(
        _build, ctx, seq_length=config.derived.seq_length,
        attention_backend=config.model.attention_backend, packed_attention=config.model.packed_attention,
        dtype=torch_dtype(config.training),
        config_overrides=model_overrides(config.model, config.parallel, config.training),
        compile_layers="layer" in (config.model.fusions or ()))
    chunks = build(source, load_weights=load_weights)
    model_path = config.model.model_name_or_path
    # Where peft's get_peft_model (a script's LoRA) puts the adapters, and how they start.
    mark_lora_sites(chunks, model_path, seed=config.training.seed)
    # What the finetuning type trains (LoRA adapters on a frozen base...), before anything wraps them.
    chunks = converter_for(config.finetuning, config.model.adapter_name_or_path).convert_chunks(
        chunks, model_path=model_path, seed=config.training.seed)
    mca_config = McaConfig(_hf_config(source), args, source if isinstance(source, str) else None)
    return McaModel(chunks, config=mca_config, source=source, session=session, builder=build)


def _build(ctx: RankContext, source: str | Path | Mapping[str, Any], *, load_weights: bool | None,
           seq_length: int, attention_backend: str, packed_attention: str, dtype: torch.dtype,
           config_overrides: Mapping[str, Any], compile_layers: bool) -> list[torch.nn.Module]:
    from hpc_mca.models.build import build_model

    if load_weights is None:
        load_weights = not isinstance(source, Mapping) and any(Path(source).glob("*.safetensors"))
    return build_model(source, ctx, load_weights=load_weights, seq_length=seq_length,
                       attention_backend=attention_backend, packed_attention=packed_attention, dtype=dtype,
                       config_overrides=config_overrides, compile_layers=compile_layers)


def _hf_config(source: str | Mapping[str, Any]) -> PretrainedConfig:
    from transformers import AutoConfig as HFAutoConfig

    if isinstance(source, Mapping):
        values = copy.deepcopy(dict(source))
        return HFAutoConfig.for_model(values.pop("model_type"), **values)
    return HFAutoConfig.from_pretrained(source)
