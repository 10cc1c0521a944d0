"""Which kernel runs packed (THD) attention on the torch backend, and the fused ones.

The torch backend has three kernels for a packed stream of documents (all compute causal
attention confined to each document; padding slots come back as zeros):

* ``varlen``: torch's ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
  ``cu_seqlens``), CUDA with fp16/bf16 only; keys/values keep their own head count (GQA).
* ``flex``: ``flex_attention`` with a block mask of the documents, built once per micro-batch
  and reused by every layer; compiled on CUDA. torch 2.13 has no flex backward on CPU, so there
  it runs forward-only (eager, the full score matrix): usable for evaluation and tests only.
* ``sdpa``: :func:`hpc_mca.models.packed_attention.packed_attention`, one 4-D
  ``scaled_dot_product_attention`` per group of documents (unmasked ``is_causal`` for a lone
  document, so fused kernels take it). Runs everywhere, any mask type, dropout, and context
  parallelism; the fastest of the three on CPU (``benchmarks/attention_packed.py``).

``resolve_packed_kernel`` picks one from ``model.packed_attention`` (``auto`` or a name) and
says why; the choice is logged once per run. The fused kernels take causal top-left
self-attention without dropout; any other call (a non-causal mask, cross-attention with other
``cu_seqlens``, dropout at training time) goes through ``sdpa``, which computes the same thing.

Per-micro-batch planning (layouts, segment plans, block masks, device copies of
``cu_seqlens``) is cached on the micro-batch's ``PackedSeqParams``: Megatron hands the same
object to every layer, so a 32-layer model plans once, not 32 times.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, cast

import torch
from torch import Tensor

from hpc_mca.config.sections import PACKED_ATTENTION, PACKED_KERNELS
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.packed_attention import TokenLayout, packed_layout

if TYPE_CHECKING:  # megatron is imported by the modules that call these kernels
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention.flex_attention import BlockMask

_T = TypeVar("_T")

__all__ = [
    "PACKED_KERNELS",
    "PackedPlan",
    "flex_packed_attention",
    "packed_plan",
    "resolve_packed_kernel",
    "varlen_available",
    "varlen_packed_attention",
]

_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _varlen_attn() -> Optional[Callable[..., Tensor]]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # Called without return_aux, as here, it returns the attention output alone.
    return cast("Callable[..., Tensor]", varlen_attn)


def varlen_available(cuda: Optional[bool] = None) -> bool:
    """True when this torch build has ``varlen_attn`` and CUDA is usable."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return cuda and _varlen_attn() is not None


def resolve_packed_kernel(preference: str, *, cuda: bool, dtype: torch.dtype,
                          dropout: float = 0.0, cp: int = 1,
                          varlen: Optional[bool] = None) -> tuple[str, str]:
    """(kernel, why) for ``model.packed_attention=preference`` on this machine.

    ``varlen`` says whether torch's varlen_attn exists (default: look). An explicit kernel that
    cannot train here raises ModelLoadError (one line, bad input) naming what would work.
    """
    valid = PACKED_ATTENTION
    if preference not in valid:
        raise ModelLoadError(f"model.packed_attention={preference!r} is not one of "
                             f"{', '.join(repr(v) for v in valid)}")
    has_varlen = (_varlen_attn() is not None) if varlen is None else varlen
    why_not = {
        "varlen": _varlen_obstacle(cuda, has_varlen, dtype, dropout, cp),
        "flex": _flex_obstacle(cuda, dropout, cp),
        "sdpa": None,
    }
    if preference != "auto":
        if why_not[preference]:
            usable = ", ".join(k for k in PACKED_ATTENTION if not why_not.get(k))
            raise ModelLoadError(f"model.packed_attention={preference!r} cannot run here: "
                                 f"{why_not[preference]}; valid here: {usable}")
        return preference, "set by model.packed_attention"
    for kernel in PACKED_KERNELS:
        if not why_not[kernel]:
            reasons = "; ".join(f"not {k}: {why_not[k]}" for k in PACKED_KERNELS[:PACKED_KERNELS.index(kernel)])
            return kernel, f"auto{' (' + reasons + ')' if reasons else ''}"
    raise AssertionError("sdpa is always possible")  # pragma: no cover


def _varlen_obstacle(cuda: bool, has_varlen: bool, dtype: torch.dtype, dropout: float,
                     cp: int) -> Optional[str]:
    if not cuda:
        return "needs CUDA"
    if not has_varlen:
        return f"this torch ({torch.__version__}) has no torch.nn.attention.varlen"
    if dtype not in _HALF:
        return f"needs bf16/fp16 weights, the model runs in {str(dtype).removeprefix('torch.')}"
    return _common_obstacle(dropout, cp)


def _flex_obstacle(cuda: bool, dropout: float, cp: int) -> Optional[str]:
    if not cuda:
        return "needs CUDA to train (torch has no flex_attention backward on CPU)"
    return _common_obstacle(dropout, cp)


def _common_obstacle(dropout: float, cp: int) -> Optional[str]:
    if dropout:
        return f"has no attention dropout (attention_dropout={dropout})"
    if cp > 1:
        return "context parallelism runs its own exchange over per-segment SDPA"
    return None


# --------------------------------------------------------------------------------------------
# Per-micro-batch plan
# --------------------------------------------------------------------------------------------


class PackedPlan:
    """What every layer of one micro-batch shares: the host layouts (for ``sdpa``), and lazily
    the device copies and masks of the fused kernels."""

    def __init__(self, q_layout: TokenLayout, kv_layout: TokenLayout, cu_q_pad: Tensor,
                 self_attention: bool) -> None:
        self.q_layout, self.kv_layout = q_layout, kv_layout
        self.cu_q_pad = cu_q_pad
        self.self_attention = self_attention
        self._device: dict[tuple[str, str], Any] = {}

    def on(self, key: str, device: torch.device, make: Callable[[], _T]) -> _T:
        """``make()`` once per (key, device)."""
        slot = (key, str(device))
        if slot not in self._device:
            self._device[slot] = make()
        return self._device[slot]

    def valid(self, device: torch.device) -> Tensor:
        """Bool ``[t_q]``: real query tokens (padding slots get zeros)."""
        return self.on("valid", device, lambda: self.q_layout.valid.to(device))


def packed_plan(params: PackedSeqParams, total_q: int, total_kv: int) -> PackedPlan:
    """The plan of the micro-batch ``params`` (a PackedSeqParams) describes, cached on it."""
    key = (total_q, total_kv)
    cached = getattr(params, "_hpc_mca_packed_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    cu_q = params.cu_seqlens_q
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is required for qkv_format 'thd'")
    cu_kv = params.cu_seqlens_kv if params.cu_seqlens_kv is not None else cu_q
    pad_q, pad_kv = params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded
    # Planned on the host: one copy of a few ints per micro-batch.
    cu_q, cu_kv = cu_q.cpu(), cu_kv.cpu()
    pad_q = None if pad_q is None else pad_q.cpu()
    pad_kv = None if pad_kv is None else pad_kv.cpu()
    q_layout = packed_layout(cu_q, pad_q, total=total_q)
    kv_layout = packed_layout(cu_kv, pad_kv, total=total_kv)
    same = total_q == total_kv and torch.equal(cu_q, cu_kv) and torch.equal(
        cu_q if pad_q is None else pad_q, cu_kv if pad_kv is None else pad_kv)
    plan = PackedPlan(q_layout, kv_layout, cu_q if pad_q is None else pad_q, same)
    params._hpc_mca_packed_plan = (key, plan)
    return plan


# --------------------------------------------------------------------------------------------
# Fused kernels (causal top-left self-attention, no dropout)
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _varlen_keywords() -> frozenset[str]:
    fn = _varlen_attn()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


def varlen_packed_attention(query: Tensor, key: Tensor, value: Tensor, plan: PackedPlan, *,
                            scale: Optional[float] = None) -> Tensor:
    """torch's varlen_attn over ``[t, heads, dim]``; the padded document ranges are the
    sequences (causality keeps a document's trailing padding out of its real tokens)."""
    fn = _varlen_attn()
    if fn is None:
        raise RuntimeError("torch.nn.attention.varlen is not available in this torch build")
    device = query.device

    def bounds() -> tuple[Tensor, int]:
        cu = plan.cu_q_pad
        return cu.to(device=device, dtype=torch.int32), int((cu[1:] - cu[:-1]).max())

    cu, longest = plan.on("varlen", device, bounds)
    words = _varlen_keywords()
    kwargs: dict[str, Any] = {"scale": scale}
    # torch 2.9-2.10 take is_causal; later builds express causality as window (-1, 0).
    kwargs.update({"window_size": (-1, 0)} if "window_size" in words else {"is_causal": True})
    if query.size(1) != key.size(1):
        if "enable_gqa" in words:
            kwargs["enable_gqa"] = True
        else:
            repeat = query.size(1) // key.size(1)
            key, value = (x.repeat_interleave(repeat, dim=1) for x in (key, value))
    end = int(plan.cu_q_pad[-1])
    ctx = fn(query[:end], key[:end], value[:end], cu, cu, longest, longest, **kwargs)
    if end < query.size(0):  # slots after the last document: zeros, as from the other kernels
        ctx = torch.cat([ctx, ctx.new_zeros(query.size(0) - end, *ctx.shape[1:])])
    return ctx.masked_fill(~plan.valid(device)[:, None, None], 0.0)


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _document_block_mask(plan: PackedPlan, device: torch.device) -> BlockMask:
    from torch.nn.attention.flex_attention import create_block_mask

    layout = plan.q_layout.to(device)
    doc, pos, valid = layout.doc, layout.pos, layout.valid

    def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        del b, h  # one mask for every head and the single packed row
        return (doc[q] == doc[kv]) & valid[kv] & (doc[q] >= 0) & (pos[kv] <= pos[q])

    total = len(layout)
    # Compiled on CUDA: the eager builder evaluates the mask on all t x t slot pairs at once.
    return create_block_mask(same_document_causal, None, None, total, total, device=device,
                             _compile=device.type == "cuda")


def flex_packed_attention(query: Tensor, key: Tensor, value: Tensor, plan: PackedPlan, *,
                          scale: Optional[float] = None) -> Tensor:
    """flex_attention over ``[t, heads, dim]`` with the documents' block mask (compiled on
    CUDA; eager and forward-only on CPU, where torch has no flex backward)."""
    mask = plan.on("flex", query.device, lambda: _document_block_mask(plan, query.device))
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    gqa = q.size(1) != k.size(1)
    if query.is_cuda:
        ctx = _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        with warnings.catch_warnings():
            # "called without torch.compile()": on CPU eager is the point (forward-only use).
            warnings.simplefilter("ignore", UserWarning)
            ctx = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    ctx = ctx[0].transpose(0, 1)
    return ctx.masked_fill(~plan.valid(query.device)[:, None, None], 0.0)
