"""Which parameters train under ``finetuning_type: freeze``, from HF parameter names.

Pure Python (no torch): the config rules check the settings with it before the process group
comes up, the planner sizes the trainable part with it, and both backends apply it
(``hpc_mca.models.freeze``): the standard backend to the transformers model's own parameter
names, the Megatron backend to the HF tensors each Megatron parameter holds.

The rule is LLaMA-Factory's (``freeze_trainable_layers``, ``freeze_trainable_modules``,
``freeze_extra_modules``), stated here on names:

* trainable layers: the last N decoder layers for N > 0, the first -N for N < 0, numbered over
  the whole model (a pipeline stage's local layers have their model-wide index);
* a module of those layers is a name directly below a layer (``self_attn``, ``mlp``,
  ``input_layernorm``, ``post_attention_layernorm``), or ``all``; an extra module is the last
  module name of a parameter outside the layers (``embed_tokens``, ``norm``, ``lm_head``);
* a parameter trains when one of the patterns ``.{layer}.`` (all), ``.{layer}.{module}`` or
  ``{extra}`` is a substring of its name. As in LLaMA-Factory, the extra module ``norm`` is
  also a substring of every layer's norms, which then train too.

Modules below a layer are all whole Megatron parameters or fused groups of them (attention's
q/k/v in ``linear_qkv``, the MLP's gate/up in ``linear_fc1``), so no rule splits a Megatron
parameter. MoE models are refused: transformers keeps their experts as fused 3-D parameters
while their checkpoints number each expert, and the ``.{layer}.`` pattern would also hit
expert numbers, so the two backends would not train the same parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hpc_mca.errors import UserError

from .layout import Layout
from .model import ModelShape

__all__ = ["FreezeError", "FreezeRule", "FreezeSizing", "freeze_rule", "freeze_sizing",
           "hf_parameter_sizes", "idle_pipeline_ranks", "layer_ids_on_rank", "split_names",
           "trainable_fraction"]

_LAYER_MODULE = re.compile(r"\.layers\.\d+\.([^.]+)\.")
_NUMBERED = re.compile(r"\.\d+\.")


class FreezeError(UserError):
    """A freeze setting that names no layer or module of the model (one line, what is valid)."""


@dataclass(frozen=True)
class FreezeRule:
    """The substring patterns of LLaMA-Factory's rule, resolved for one model."""

    layers: tuple[int, ...]
    """Model-wide indices of the decoder layers that train (some of their modules)."""
    patterns: tuple[str, ...]
    """A parameter trains when one of these is a substring of its HF name."""

    def trains(self, hf_name: str) -> bool:
        return any(pattern in hf_name for pattern in self.patterns)


def split_names(value: list[str] | str | None) -> list[str]:
    """A list setting given as a list or as a comma-separated string, stripped."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def _trainable_layers(num_layers: int, count: int) -> tuple[int, ...]:
    if not count or abs(count) > num_layers:
        raise FreezeError(f"finetuning.freeze_trainable_layers={count} with a model of "
                          f"{num_layers} decoder layers; valid: 1..{num_layers} (the last N "
                          f"layers train) or -{num_layers}..-1 (the first N)")
    return tuple(range(num_layers - count, num_layers)) if count > 0 else tuple(range(-count))


def freeze_rule(names: Iterable[str], num_layers: int, trainable_layers: int,
                modules: list[str] | str, extra: list[str] | str | None) -> FreezeRule:
    """The rule for a model whose HF parameter names are ``names``; FreezeError (one line,
    the valid names) for a module the model's layers, or its other parts, do not have."""
    names = list(names)
    below = sorted({m.group(1) for n in names if (m := _LAYER_MODULE.search(n))})
    outside = sorted({n.split(".")[-2] for n in names if not _NUMBERED.search(n) and "." in n})
    layers = _trainable_layers(num_layers, trainable_layers)
    wanted = split_names(modules)
    unknown = [m for m in wanted if m != "all" and m not in below]
    if unknown or not wanted:
        raise FreezeError(f"finetuning.freeze_trainable_modules={wanted!r}: "
                          f"{', '.join(unknown) or 'nothing'} is not a module of a decoder layer "
                          f"(whole modules only: Megatron fuses their parts); valid: all, "
                          + ", ".join(below))
    extras = split_names(extra)
    unknown = [m for m in extras if m not in outside]
    if unknown:
        raise FreezeError(f"finetuning.freeze_extra_modules={extras!r}: {', '.join(unknown)} "
                          f"is not a module outside the decoder layers; valid: "
                          + ", ".join(outside))
    patterns = [f".{layer}." if module == "all" else f".{layer}.{module}"
                for module in wanted for layer in layers]
    return FreezeRule(layers, tuple(dict.fromkeys(patterns + extras)))


def hf_parameter_sizes(shape: ModelShape) -> dict[str, int]:
    """The HF parameter names of a dense model of ``shape`` (Llama-style names, as every
    supported dense family has), with their element counts; qkv biases and q/k norms, which
    ModelShape does not know, are left out (their modules' names are there)."""
    h, d = shape.hidden_size, shape.kv_channels
    q, kv, f = shape.num_attention_heads * d, shape.num_query_groups * d, shape.ffn_hidden_size
    sizes = {"model.embed_tokens.weight": shape.vocab_size * h}
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        sizes.update({p + "input_layernorm.weight": h, p + "self_attn.q_proj.weight": q * h,
                      p + "self_attn.k_proj.weight": kv * h, p + "self_attn.v_proj.weight": kv * h,
                      p + "self_attn.o_proj.weight": h * q, p + "post_attention_layernorm.weight": h,
                      p + "mlp.gate_proj.weight": f * h, p + "mlp.up_proj.weight": f * h,
                      p + "mlp.down_proj.weight": h * f})
    sizes["model.norm.weight"] = h
    if not shape.tie_word_embeddings:
        sizes["lm_head.weight"] = shape.vocab_size * h
    return sizes


def trainable_fraction(sizes: Mapping[str, int], rule: FreezeRule) -> float:
    """The share of the parameters (by element count) that train under ``rule``."""
    total = sum(sizes.values())
    return sum(n for name, n in sizes.items() if rule.trains(name)) / total if total else 0.0


@dataclass(frozen=True)
class FreezeSizing:
    """What trains under a freeze rule, in the planner's units: the memory estimate gives
    gradients and optimizer state to these parts only."""

    layer_shares: tuple[float, ...]
    """Per decoder layer (model-wide index): the share of its parameters that train."""
    embedding: bool
    """The input embedding trains."""
    output: bool
    """The output layer trains (``lm_head``; a tied one with the embedding)."""


def freeze_sizing(shape: ModelShape, rule: FreezeRule) -> FreezeSizing:
    """The planner's view of ``rule`` on a dense model of ``shape``."""
    sizes = hf_parameter_sizes(shape)
    shares = []
    for layer in range(shape.num_layers):
        mine = {n: size for n, size in sizes.items() if n.startswith(f"model.layers.{layer}.")}
        shares.append(trainable_fraction(mine, rule))
    embedding = rule.trains("model.embed_tokens.weight")
    output = embedding if shape.tie_word_embeddings else rule.trains("lm_head.weight")
    return FreezeSizing(tuple(shares), embedding, output)


def layer_ids_on_rank(model: ModelShape, layout: Layout, rank: int) -> list[int]:
    """Model-wide indices of the layers pipeline rank ``rank`` holds: virtual stage
    ``chunk * PP + rank`` for each of its chunks, in order."""
    stages = layout.pp * (layout.vp or 1)
    sizes = layout.pipeline_layout or (model.num_layers // stages,) * stages
    starts = [sum(sizes[:v]) for v in range(len(sizes))]
    return [layer for v in range(rank, len(sizes), layout.pp)
            for layer in range(starts[v], starts[v] + sizes[v])]


def idle_pipeline_ranks(shape: ModelShape, layout: Layout, sizing: FreezeSizing) -> list[int]:
    """Pipeline ranks that would hold nothing to train (no trained layer, and neither a
    trained embedding on the first nor a trained output layer on the last)."""
    idle = []
    for rank in range(layout.pp):
        tables = (rank == 0 and sizing.embedding) or (rank == layout.pp - 1 and sizing.output)
        if not tables and not any(sizing.layer_shares[i] for i in layer_ids_on_rank(shape, layout, rank)):
            idle.append(rank)
    return idle
