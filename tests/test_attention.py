"""The torch attention backend against per-document SDPA and Megatron's own DotProductAttention,
and the backend switch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from hpc_mca.models.attention import (
    TorchCoreAttention,
    attention_allowed,
    core_attention_class,
    packed_attention,
    packed_layout,
)
from hpc_mca.models.attention_backend import (
    check_context_parallel,
    choose_attention_backend,
    select_attention_backend,
)
from hpc_mca.models.errors import ModelLoadError

HEAD_DIM = 16


def make_config(heads: int = 4, groups: int | None = None, **overrides) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=heads * HEAD_DIM,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=HEAD_DIM,
        attention_dropout=overrides.pop("attention_dropout", 0.0),
        masked_softmax_fusion=False,
        **overrides,
    )


def make_attention(config: TransformerConfig, **kwargs) -> TorchCoreAttention:
    kwargs.setdefault("attn_mask_type", AttnMaskType.causal)
    return TorchCoreAttention(config=config, layer_number=1, attention_type="self", **kwargs)


def thd_params(lengths: list[int], padded: list[int] | None = None) -> PackedSeqParams:
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    cu_padded = None if padded is None else torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )


def qkv(tokens: int, heads: int, groups: int, seed: int = 0, grad: bool = False):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((tokens, heads, HEAD_DIM), (tokens, groups, HEAD_DIM), (tokens, groups, HEAD_DIM))
    return [torch.randn(s, generator=generator).requires_grad_(grad) for s in shapes]


def reference_document(q, k, v, scale=None):
    """One document alone through SDPA causal; [n, h, d] in and out, keys repeated for GQA."""
    repeat = q.size(1) // k.size(1)
    k, v = (x.repeat_interleave(repeat, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


LENGTHS = [7, 1, 33, 12, 64, 3, 20]


@pytest.mark.parametrize("segment_tokens", [1, 48, 10**6], ids=["per-doc", "grouped", "one-mask"])
def test_packed_documents_match_each_document_alone(segment_tokens):
    heads = 4
    module = make_attention(make_config(heads), segment_tokens=segment_tokens)
    q, k, v = qkv(sum(LENGTHS), heads, heads, grad=True)
    out = module(q, k, v, None, packed_seq_params=thd_params(LENGTHS))
    assert out.shape == (sum(LENGTHS), heads * HEAD_DIM)
    out.square().sum().backward()
    packed_grads = [x.grad.clone() for x in (q, k, v)]

    for x in (q, k, v):
        x.grad = None
    start = 0
    for n in LENGTHS:
        piece = slice(start, start + n)
        expected = reference_document(q[piece], k[piece], v[piece])
        torch.testing.assert_close(out[piece].view_as(expected), expected, atol=1e-5, rtol=0)
        expected.square().sum().backward()
        start += n
    for packed, alone in zip(packed_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_thd_accepts_an_unsqueezed_batch_dimension():
    module = make_attention(make_config())
    q, k, v = qkv(sum(LENGTHS), 4, 4)
    params = thd_params(LENGTHS)
    flat = module(q, k, v, None, packed_seq_params=params)
    batched = module(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)
    assert torch.equal(flat, batched)


def _padding_slots(lengths: list[int], padded: list[int], total: int) -> torch.Tensor:
    slots = torch.ones(total, dtype=torch.bool)
    start = 0
    for n, p in zip(lengths, padded):
        slots[start : start + n] = False
        start += p
    return slots


@pytest.mark.parametrize("segment_tokens", [1, 10**6])
def test_packed_padding_never_leaks_into_real_tokens(segment_tokens):
    lengths, padded = [5, 9, 1, 14], [8, 12, 4, 16]
    total = sum(padded) + 6  # trailing slots after the last document as well
    pad = _padding_slots(lengths, padded, total)
    module = make_attention(make_config(4, 2), segment_tokens=segment_tokens)
    params = thd_params(lengths, padded)
    q, k, v = qkv(total, 4, 2, grad=True)
    out = module(q, k, v, None, packed_seq_params=params)
    out.sum().backward()

    noisy = [x.detach().clone() for x in (q, k, v)]
    for x in noisy:
        x[pad] = 1e4 * torch.randn_like(x[pad])
    noisy_out = module(*noisy, None, packed_seq_params=params)

    torch.testing.assert_close(noisy_out[~pad], out[~pad], atol=1e-6, rtol=0)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[pad], torch.zeros_like(x.grad[pad]))
    # Real tokens still see exactly their own document.
    start = 0
    for n, p in zip(lengths, padded):
        piece = slice(start, start + n)
        expected = reference_document(q[piece], k[piece], v[piece]).detach()
        torch.testing.assert_close(out[piece].view_as(expected), expected, atol=1e-5, rtol=0)
        start += p


def test_sbhd_padding_mask_never_leaks():
    seq, batch, heads = 12, 3, 4
    valid = torch.tensor([12, 7, 3])
    key_padding = torch.arange(seq)[None, :] >= valid[:, None]  # [b, s], True = padding
    mask = key_padding[:, None, None, :]  # [b, 1, 1, s], True = masked
    module = make_attention(make_config(heads), attn_mask_type=AttnMaskType.padding_causal)
    q, k, v = (x.view(seq, batch, *x.shape[1:]) for x in qkv(seq * batch, heads, heads))
    out = module(q, k, v, mask).view(seq, batch, heads, HEAD_DIM)

    noisy = [x.clone() for x in (q, k, v)]
    for x in noisy:
        x.transpose(0, 1)[key_padding] = 1e4
    noisy_out = module(*noisy, mask).view(seq, batch, heads, HEAD_DIM)
    real = ~key_padding.T  # [s, b]
    torch.testing.assert_close(noisy_out[real], out[real], atol=1e-6, rtol=0)
    assert torch.isfinite(noisy_out).all()
    for b in range(batch):
        n = int(valid[b])
        expected = reference_document(q[:n, b], k[:n, b], v[:n, b])
        torch.testing.assert_close(out[:n, b], expected, atol=1e-5, rtol=0)


def test_grouped_query_attention_matches_repeated_heads():
    heads, groups, seq, batch = 8, 2, 10, 2
    module = make_attention(make_config(heads, groups))
    q, k, v = qkv(seq * batch, heads, groups)
    q, k, v = (x.view(seq, batch, *x.shape[1:]) for x in (q, k, v))
    out = module(q, k, v, None).view(seq, batch, heads, HEAD_DIM)
    for b in range(batch):
        torch.testing.assert_close(
            out[:, b], reference_document(q[:, b], k[:, b], v[:, b]), atol=1e-5, rtol=0
        )

    tq, tk, tv = qkv(sum(LENGTHS), heads, groups)
    packed = module(tq, tk, tv, None, packed_seq_params=thd_params(LENGTHS))
    start = 0
    for n in LENGTHS:
        piece = slice(start, start + n)
        expected = reference_document(tq[piece], tk[piece], tv[piece])
        torch.testing.assert_close(packed[piece].view_as(expected), expected, atol=1e-5, rtol=0)
        start += n

    with pytest.raises(ValueError, match="not a multiple"):
        module(*qkv(6, 8, 3), None, packed_seq_params=thd_params([6]))


def test_softmax_scale_is_applied():
    module = make_attention(make_config(), softmax_scale=0.05)
    q, k, v = qkv(9, 4, 4)
    out = module(q, k, v, None, packed_seq_params=thd_params([9]))
    torch.testing.assert_close(
        out.view(9, 4, HEAD_DIM), reference_document(q, k, v, scale=0.05), atol=1e-6, rtol=0
    )


def test_attention_dropout_from_config_only_in_training():
    module = make_attention(make_config(attention_dropout=0.5))
    q, k, v = (x.view(16, 1, 4, HEAD_DIM) for x in qkv(16, 4, 4))
    module.eval()
    assert torch.equal(module(q, k, v, None), module(q, k, v, None))
    module.train()
    torch.manual_seed(0)
    dropped = module(q, k, v, None)
    assert not torch.allclose(dropped, module.eval()(q, k, v, None))


# --- context-parallel readiness: a rank's slots give the rows of the full result -------------


def test_layout_of_mirrored_cp_chunks_gives_rows_of_the_full_result():
    lengths = [8, 16]  # each document cut into 4 chunks for CP=2
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    full = packed_layout(cu)
    q, k, v = qkv(24, 4, 4)
    expected = packed_attention(q, k, v, full, full)
    for rank in (0, 1):
        slots = []
        for start, n in zip((0, 8), lengths):
            chunk = n // 4
            for c in (rank, 3 - rank):  # rank 0 holds [c0, c3], rank 1 holds [c1, c2]
                slots += range(start + c * chunk, start + (c + 1) * chunk)
        slots = torch.tensor(slots)
        local = packed_layout(cu, slots=slots)
        assert torch.equal(
            attention_allowed(local, full, causal=True),
            attention_allowed(full, full, causal=True)[slots],
        )
        out = packed_attention(q[slots], k, v, local, full)
        torch.testing.assert_close(out, expected[slots], atol=1e-6, rtol=0)


def test_packed_layout_marks_documents_positions_and_padding():
    layout = packed_layout(torch.tensor([0, 2, 3]), torch.tensor([0, 4, 6]), total=7)
    assert layout.doc.tolist() == [0, 0, 0, 0, 1, 1, -1]
    assert layout.pos.tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert layout.valid.tolist() == [True, True, False, False, True, False, False]
    with pytest.raises(ValueError, match="never decrease"):
        packed_layout(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="longer than its padded"):
        packed_layout(torch.tensor([0, 3]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="holds 3 tokens"):
        packed_layout(torch.tensor([0, 4]), total=3)


# --- against Megatron's local DotProductAttention -------------------------------------------


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """World-size-1 gloo group and parallel_state, torn down only if this module set them up."""
    created_group = not dist.is_initialized()
    if created_group:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    created_state = not parallel_state.model_parallel_is_initialized()
    if created_state:
        parallel_state.initialize_model_parallel()
    yield
    if created_state:
        parallel_state.destroy_model_parallel()
    if created_group:
        dist.destroy_process_group()


@pytest.fixture
def megatron_on_cpu(model_parallel, monkeypatch):
    """What DotProductAttention needs on CPU without a CUDA shim.

    Its forward (a) takes the score buffer from parallel_state's global memory buffer, which
    allocates on torch.cuda.current_device(): a large enough CPU buffer is put there first;
    (b) forks the CUDA RNG tracker for dropout: the inference tracker (a no-op fork) stands in,
    and the module's tracker globals are restored afterwards; (c) builds its default causal mask
    on "cuda": tests pass the mask explicitly.
    """
    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        monkeypatch.setattr(mcore_random, name, getattr(mcore_random, name))
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    buffer = parallel_state.get_global_memory_buffer().buffer
    key = ("mpu", torch.float32)
    saved = buffer.get(key)
    buffer[key] = torch.empty(1 << 16)
    yield
    if saved is None:
        buffer.pop(key, None)
    else:
        buffer[key] = saved


@pytest.mark.parametrize(
    "heads,groups,softmax_scale",
    [(4, 4, None), (8, 2, None), (4, 2, 0.3)],
    ids=["mha", "gqa", "scale"],
)
def test_causal_output_matches_megatron_dot_product_attention(
    megatron_on_cpu, heads, groups, softmax_scale
):
    seq, batch = 16, 2
    config = make_config(heads, groups)
    kwargs = dict(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=softmax_scale,
    )
    theirs, ours = DotProductAttention(**kwargs).eval(), TorchCoreAttention(**kwargs).eval()
    q, k, v = (x.view(seq, batch, *x.shape[1:]) for x in qkv(seq * batch, heads, groups))
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(diagonal=1)[None, None]
    expected = theirs(q, k, v, causal)
    assert expected.shape == (seq, batch, heads * HEAD_DIM)
    torch.testing.assert_close(ours(q, k, v, None), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours(q, k, v, causal), expected, atol=1e-5, rtol=0)


# --- configuration and backend selection ----------------------------------------------------


def test_unsupported_configurations_are_refused():
    # Megatron's default exchange (p2p, the ring) is Transformer Engine's alone.
    with pytest.raises(ValueError, match="cp_comm_type='p2p' needs the 'te' attention backend"):
        make_attention(make_config(context_parallel_size=2))
    with pytest.raises(ValueError, match="softmax_type='off-by-one'"):
        make_attention(make_config(softmax_type="off-by-one"))
    with pytest.raises(ValueError, match="attention_bias"):
        make_attention(make_config())(*qkv(4, 4, 4), None, attention_bias=torch.zeros(1))


def test_context_parallel_support_by_backend():
    check_context_parallel("torch", 1, None)
    check_context_parallel("torch", 2, "a2a")
    check_context_parallel("te", 4, "p2p")
    with pytest.raises(ModelLoadError, match=r"cp_comm_type='p2p' needs the 'te' attention "
                                             r"backend; valid with the 'torch' backend: "
                                             r"all_gather, a2a"):
        check_context_parallel("torch", 2, "p2p")
    with pytest.raises(ModelLoadError, match="context_parallel_size=2 is not supported by the "
                                             "'flash' attention backend"):
        check_context_parallel("flash", 2, "all_gather")


def test_auto_prefers_te_then_flash_then_torch():
    assert choose_attention_backend("auto", ["te", "flash", "torch"]) == "te"
    assert choose_attention_backend("auto", ["flash", "torch"]) == "flash"
    assert choose_attention_backend("auto", ["torch"]) == "torch"
    assert choose_attention_backend("flash", ["te", "flash", "torch"]) == "flash"


def test_explicit_backend_errors_name_the_value_and_what_is_available():
    with pytest.raises(ValueError, match=r"'te' is not available.*available: flash, torch"):
        choose_attention_backend("te", ["flash", "torch"])
    with pytest.raises(ValueError, match=r"'sdpa' is not one of 'auto', 'te', 'flash', 'torch'"):
        select_attention_backend("sdpa")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cpu_machine_selects_torch():
    assert select_attention_backend() == "torch"
    assert select_attention_backend("torch") == "torch"
    assert core_attention_class() is TorchCoreAttention
    for unavailable in ("te", "flash"):
        message = f"'{unavailable}' is not available here.*available: torch$"
        with pytest.raises(ValueError, match=message):
            select_attention_backend(unavailable)
