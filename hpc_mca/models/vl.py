"""``McaVLModel``: a vision-language chunk (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on Megatron-Core's
GPTModel.

The first pipeline stage holds transformers' own vision tower of the family
(:func:`~hpc_mca.models.vl_config.build_vision_tower`; whole on every TP rank, which all see the
same images), encodes ``pixel_values`` into one feature row per image token and puts those rows
in place of the word embeddings of the ``image_token_id`` positions, read in ``[batch, seq]``
row-major order as transformers does. Megatron lays the sequence out ``[seq, batch, hidden]``,
so the replacement happens on a ``[batch, seq]`` view, and only then is the sequence split over
the TP ranks under sequence parallelism (the embedding is built without its own scatter). Every
stage then runs GPTModel with multimodal rope: ``position_ids`` ``[3, batch, seq]`` (time,
height, width rows; in a packed row each document's positions restart) turn the
``mrope_section`` frequency bands, as transformers' Qwen2-VL text model does (Qwen3-VL:
the bands interleaved, :func:`~hpc_mca.models.vl_config.mrope_rows`).

Qwen3-VL's tower also gives deepstack features, one set per early decoder layer: set ``j`` is
added to decoder layer ``j``'s output at the image tokens (transformers' ``_deepstack_process``).
The first stage builds each set as a ``[seq, batch, hidden]`` addend (zero off the image
tokens, this rank's share under sequence parallelism, as the embeddings are), hands them to
its layers on the rope angles of the micro-batch (every layer receives that one tensor) and a
forward hook on each of those layers adds its set. The first stage must hold all those layers
and full activation recompute (which detaches the angles it re-runs with) is refused
(:mod:`.build`).

Megatron's own ``MultimodalRotaryEmbedding`` allocates its frequencies on the current CUDA
device (so cannot be built on a CPU), and its packed (THD) path would rotate every document
with the first positions' angles; :class:`MropeEmbedding` takes its place and returns each
token's angles, which :func:`hpc_mca.models.rope.packed_rope` applies token by token.

Imported by :mod:`.build` when it builds a VL model (megatron is imported here, at module
level).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
from megatron.core import tensor_parallel
from torch import Tensor

from hpc_mca.models.gpt import McaGPTModel
from hpc_mca.models.rope import per_token
from hpc_mca.models.vl_config import VisionSpec, build_vision_tower, mrope_rows

__all__ = ["McaVLModel", "MropeEmbedding"]

# Megatron warns that TE's fused rope cannot take mrope angles of a batch > 1 and runs its
# unfused bshd rotation instead: the same arithmetic as this package's unfused slot.
warnings.filterwarnings("ignore", message="apply_rope_fusion does not support mRoPE")


class MropeEmbedding(torch.nn.Module):
    """Multimodal rope angles ``[seq, batch, 1, rot_dim]`` of ``position_ids`` ``[3, batch,
    seq]``: rotary band ``i`` turns with position row ``rows[i]`` (both halves alike)."""

    def __init__(self, inv_freq: Tensor, rows: Sequence[int]) -> None:
        super().__init__()
        self.inv_freq = inv_freq  # a plain attribute, as Megatron's: never in a state dict
        self.rows = torch.tensor(list(rows), dtype=torch.long, device=inv_freq.device)
        self.deepstack: list[Tensor] | None = None
        """The next forward's deepstack addends (:class:`McaVLModel`), put on its angles."""

    def forward(self, position_ids: Tensor, mrope_section: Sequence[int],
                cp_group: torch.distributed.ProcessGroup | None = None) -> Tensor:
        positions = position_ids.to(self.inv_freq.device, torch.float32)
        freqs = positions[..., None] * self.inv_freq  # [3, b, s, rot/2]
        index = self.rows.expand(1, *freqs.shape[1:])
        mixed = freqs.gather(0, index)[0]  # [b, s, rot/2], each band from its row
        angles = per_token(torch.cat((mixed, mixed), dim=-1).transpose(0, 1)[:, :, None, :]
                           .contiguous())
        if self.deepstack is not None:
            setattr(angles, _DEEPSTACK, self.deepstack)
            self.deepstack = None
        return angles


_DEEPSTACK = "hpc_mca_deepstack"


def _add_deepstack(level: int, module: torch.nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any], output: tuple[Tensor, Any]) -> tuple[Tensor, Any] | None:
    """Forward hook of decoder layer ``level``: its output plus the micro-batch's deepstack set
    ``level`` (none when the micro-batch has no images)."""
    addends = getattr(kwargs.get("rotary_pos_emb"), _DEEPSTACK, None)
    if addends is None:
        return None
    hidden, context = output
    return hidden + addends[level], context


class McaVLModel(McaGPTModel):
    """GPTModel with a vision tower on its first stage and multimodal rope (module docstring).

    Built with the GPTModel arguments plus ``vision`` (the tower and its image token) and
    ``seed`` (the tower's random initialisation, the same on every rank)."""

    def __init__(self, *, vision: VisionSpec, seed: int, mrope_interleaved: bool = False,
                 **kwargs: Any) -> None:  # Any: GPTModel's own arguments
        kwargs.update(position_embedding_type="rope", scatter_embedding_sequence_parallel=False)
        super().__init__(**kwargs)
        # The mrope branch of GPTModel.forward, with angles this package computes.
        self.position_embedding_type = "mrope"
        self.mrope_section = list(self.config.mrope_section)
        self.rotary_pos_emb = MropeEmbedding(
            cast(Tensor, self.get_submodule("rotary_pos_emb").inv_freq),
            mrope_rows(self.mrope_section, mrope_interleaved))
        self.image_token_id = vision.image_token_id
        self.visual = build_vision_tower(vision, self.config.params_dtype, seed) \
            if self.pre_process else None
        if self.pre_process:
            for layer in cast(Sequence[torch.nn.Module], self.decoder.layers):
                level = cast(int, layer.layer_number) - 1
                if level < vision.deepstack_layers:
                    layer.register_forward_hook(functools.partial(_add_deepstack, level),
                                                with_kwargs=True)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor | None,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        *args: Any,  # Any: GPTModel's further positional arguments, passed on
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        **kwargs: Any,  # Any: GPTModel's keyword arguments (packed_seq_params, loss_mask, ...)
    ) -> Tensor:
        """GPTModel's forward; on the first stage ``pixel_values`` ``[patches, C·T·P·P]`` of the
        images whose grids are ``image_grid_thw`` ``[images, 3]`` (in the order their tokens
        occur in ``input_ids`` read row by row) replace the image tokens' embeddings.
        ``position_ids`` are mrope's ``[3, batch, seq]``."""
        if kwargs.get("pixel_values_videos") is not None:
            raise ValueError("pixel_values_videos: video inputs are not supported by the Megatron "
                             "VL model; valid: images (pixel_values, image_grid_thw)")
        if position_ids.dim() != 3 or position_ids.size(0) != 3:
            raise ValueError(f"position_ids of shape {list(position_ids.shape)}: a VL model takes "
                             "multimodal rope positions [3, batch, seq]")
        if decoder_input is None and self.pre_process:
            decoder_input, self.rotary_pos_emb.deepstack = self._embed(
                input_ids, pixel_values, image_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                               *args, **kwargs)

    def embed(self, input_ids: Tensor, pixel_values: Tensor | None,
              image_grid_thw: Tensor | None) -> Tensor:
        """The decoder input ``[seq, batch, hidden]`` (this rank's sequence share under
        sequence parallelism): word embeddings, image features at the image tokens."""
        return self._embed(input_ids, pixel_values, image_grid_thw)[0]

    def _embed(self, input_ids: Tensor, pixel_values: Tensor | None, image_grid_thw: Tensor | None
               ) -> tuple[Tensor, list[Tensor] | None]:
        """:meth:`embed`'s input and the deepstack addends (None without images or sets)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole
        deepstack = None
        if pixel_values is not None:
            features, levels = self._features(input_ids, pixel_values, image_grid_thw)
            mask = input_ids == self.image_token_id  # [b, s]
            embeddings = _at_images(embeddings, mask, features)
            deepstack = [_at_images(torch.zeros_like(embeddings), mask, level)
                         for level in levels] or None
        if self.config.sequence_parallel:
            embeddings, *rest = (tensor_parallel.scatter_to_sequence_parallel_region(
                tensor, group=self.pg_collection.tp) for tensor in [embeddings, *(deepstack or [])])
            deepstack = rest or None
        return embeddings, deepstack

    def _features(self, input_ids: Tensor, pixel_values: Tensor, image_grid_thw: Tensor | None
                  ) -> tuple[Tensor, list[Tensor]]:
        """The tower's feature rows ``[image tokens, hidden]`` and its deepstack sets (as many
        rows each; none for Qwen2-VL's towers)."""
        if image_grid_thw is None:
            raise ValueError("pixel_values without image_grid_thw: each image's [t, h, w] patch "
                             "grid is needed")
        assert self.visual is not None  # built on every first stage
        dtype = next(self.visual.parameters()).dtype
        out = self.visual(pixel_values.to(dtype), grid_thw=image_grid_thw)
        features = out.pooler_output
        tokens = int((input_ids == self.image_token_id).sum())
        if tokens != features.size(0):
            raise ValueError(f"input_ids hold {tokens} image tokens (id {self.image_token_id}) "
                             f"but the {image_grid_thw.size(0)} images give {features.size(0)} "
                             "feature rows; they must be equal")
        return features, list(getattr(out, "deepstack_features", None) or [])


def _at_images(rows: Tensor, mask: Tensor, features: Tensor) -> Tensor:
    """``rows`` ``[s, b, h]`` with ``features`` at the ``mask`` ``[b, s]`` positions, read in
    ``[b, s]`` row-major order as the features are ordered."""
    placed = rows.transpose(0, 1).masked_scatter(mask[..., None], features.to(rows.dtype))
    return placed.transpose(0, 1).contiguous()
