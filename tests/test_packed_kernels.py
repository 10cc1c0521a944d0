"""The packed-attention kernels of the torch backend (sdpa, flex, varlen): each one against
every document alone, the automatic choice, and the per-micro-batch plan.

On CPU, ``sdpa`` trains and ``flex`` runs forward-only (torch has no flex backward there);
``varlen`` and compiled flex need CUDA and are tested under the ``gpu`` mark.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import (
    HEAD_DIM,
    _padding_slots,
    make_attention,
    make_config,
    qkv,
    reference_document,
    thd_params,
)

from hpc_mca.config.sections import PACKED_ATTENTION
from hpc_mca.models.errors import ModelLoadError
from hpc_mca.models.packed_kernels import PACKED_KERNELS, packed_plan, resolve_packed_kernel

# Odd lengths, padded ranges and slots after the last document: every layout case at once.
LENGTHS, PADDED = [7, 1, 33, 12, 64, 3, 20], [8, 4, 36, 12, 64, 8, 24]
TRAILING = 5


def _per_document(q, k, v, lengths, padded):
    out, start = [], 0
    for n, p in zip(lengths, padded):
        out.append(reference_document(q[start:start + n], k[start:start + n],
                                      v[start:start + n]))
        start += p
    return torch.cat(out)


def _real(lengths, padded, total):
    return ~_padding_slots(lengths, padded, total)


def _run(kernel: str, heads: int, groups: int, *, device: str = "cpu",
         dtype: torch.dtype = torch.float32, grad: bool = False):
    """(output, q, k, v, real-slot mask) of ``kernel`` on the packed layout above."""
    total = sum(PADDED) + TRAILING
    module = make_attention(make_config(heads, groups), packed_kernel=kernel)
    params = thd_params(LENGTHS, PADDED)
    q, k, v = (x.to(device=device, dtype=dtype).requires_grad_(grad)
               for x in qkv(total, heads, groups))
    with torch.set_grad_enabled(grad):
        out = module(q, k, v, None, packed_seq_params=params)
    return out.view(total, heads, HEAD_DIM), (q, k, v), _real(LENGTHS, PADDED, total)


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_cpu_kernels_equal_each_document_alone(kernel, heads, groups):
    out, (q, k, v), real = _run(kernel, heads, groups)
    expected = _per_document(q, k, v, LENGTHS, PADDED)
    torch.testing.assert_close(out[real], expected, atol=1e-5, rtol=0)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))


def test_flex_and_sdpa_agree_everywhere_on_cpu():
    flex, _, _ = _run("flex", 4, 2)
    sdpa, _, _ = _run("sdpa", 4, 2)
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=0)


def test_every_layer_of_a_micro_batch_shares_one_plan():
    params = thd_params(LENGTHS, PADDED)
    total = sum(PADDED) + TRAILING
    first = packed_plan(params, total, total)
    assert packed_plan(params, total, total) is first
    assert first.self_attention
    # A second module on the same micro-batch plans nothing new: its segments are reused.
    q, k, v = qkv(total, 4, 4)
    make_attention(make_config(4))(q, k, v, None, packed_seq_params=params)
    keys = set(first._device)
    make_attention(make_config(4))(q, k, v, None, packed_seq_params=params)
    assert set(first._device) == keys and any(key.startswith("segments/") for key, _ in keys)
    # Another micro-batch (a new params object) gets its own plan.
    assert packed_plan(thd_params(LENGTHS, PADDED), total, total) is not first


def test_config_choices_are_the_kernels():
    assert PACKED_ATTENTION == ("auto", *PACKED_KERNELS)


@pytest.mark.parametrize("cuda,dtype,dropout,cp,varlen,expected", [
    (False, torch.float32, 0.0, 1, True, "sdpa"),
    (False, torch.bfloat16, 0.0, 1, True, "sdpa"),
    (True, torch.bfloat16, 0.0, 1, True, "varlen"),
    (True, torch.bfloat16, 0.0, 1, False, "flex"),
    (True, torch.float32, 0.0, 1, True, "flex"),
    (True, torch.bfloat16, 0.1, 1, True, "sdpa"),
    (True, torch.bfloat16, 0.0, 2, True, "sdpa"),
])
def test_auto_choice(cuda, dtype, dropout, cp, varlen, expected):
    kernel, why = resolve_packed_kernel("auto", cuda=cuda, dtype=dtype, dropout=dropout, cp=cp,
                                        varlen=varlen)
    assert kernel == expected
    assert why.startswith("auto")


@pytest.mark.parametrize("preference,kwargs,message", [
    ("varlen", dict(cuda=False, dtype=torch.bfloat16),
     "model.packed_attention='varlen' cannot run here: needs CUDA; valid here: auto, sdpa"),
    ("flex", dict(cuda=False, dtype=torch.float32),
     "model.packed_attention='flex' cannot run here: needs CUDA to train (torch has no "
     "flex_attention backward on CPU); valid here: auto, sdpa"),
    ("varlen", dict(cuda=True, dtype=torch.float32, varlen=True),
     "model.packed_attention='varlen' cannot run here: needs bf16/fp16 weights, the model runs "
     "in float32; valid here: auto, flex, sdpa"),
    ("flex", dict(cuda=True, dtype=torch.bfloat16, cp=2, varlen=True),
     "model.packed_attention='flex' cannot run here: context parallelism runs its own exchange "
     "over per-segment SDPA; valid here: auto, sdpa"),
    ("fast", dict(cuda=False, dtype=torch.float32),
     "model.packed_attention='fast' is not one of 'auto', 'varlen', 'flex', 'sdpa'"),
])
def test_a_kernel_that_cannot_train_here_is_one_line(preference, kwargs, message):
    with pytest.raises(ModelLoadError) as err:
        resolve_packed_kernel(preference, **kwargs)
    assert str(err.value) == message


def test_explicit_choice_is_kept_when_possible():
    assert resolve_packed_kernel("sdpa", cuda=True, dtype=torch.bfloat16, varlen=True) == (
        "sdpa", "set by model.packed_attention")


# --------------------------------------------------------------------------------------------
# CUDA: fused kernels forward and backward against the per-document math reference
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["varlen", "flex", "sdpa"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_cuda_kernels_equal_each_document_alone(kernel, heads, groups):
    from hpc_mca.models.packed_kernels import varlen_available

    if kernel == "varlen" and not varlen_available():
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    out, tensors, real = _run(kernel, heads, groups, device="cuda", dtype=torch.bfloat16,
                              grad=True)
    out.float().square().sum().backward()
    got = [x.grad.float() for x in tensors]
    ref = [x.detach().float().requires_grad_() for x in tensors]
    expected = _per_document(*ref, LENGTHS, PADDED)
    # bf16 kernels against an fp32 reference: bf16's 8-bit mantissa (~4e-3 relative).
    torch.testing.assert_close(out[real].float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))
    expected.square().sum().backward()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r.grad, atol=5e-2, rtol=5e-2)
