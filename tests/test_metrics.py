"""The MFU inputs: FLOPs per token (PaLM's convention, as the README states) and the peak table."""

from __future__ import annotations

import pytest

from hpc_mca.loop.metrics import flops_per_token, peak_flops_of
from hpc_mca.topology import ModelShape


def test_flops_per_token_is_six_per_active_weight_plus_palms_attention_term():
    # Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads of 64, 8 KV groups, FFN 8192.
    shape = ModelShape(num_layers=16, hidden_size=2048, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=8192, vocab_size=128256)
    weights = 16 * (2048 * 64 * (32 * 2 + 8 * 2) + 3 * 2048 * 8192) + 2048 * 128256
    assert weights == pytest.approx(1.236e9, rel=1e-3)  # the 1.24 B non-embedding + head count
    assert flops_per_token(shape, 4096) == 6 * weights + 12 * 16 * 32 * 64 * 4096


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989), ("NVIDIA GH200 480GB", 989), ("NVIDIA B200", 2250),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L40S", 362), ("Tesla V100-SXM2-32GB", None),
])
def test_peak_table_takes_the_dense_bf16_figure_of_the_right_variant(name, tflops):
    assert peak_flops_of(name) == (None if tflops is None else tflops * 1e12)
