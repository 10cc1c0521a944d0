"""One layer's attention as the memory and cost models size it: GQA, or DeepSeek's multi-latent
attention (MLA), whose projections Megatron-Core splits over TP differently (memory.py counts
their parameters and saved activations, cost.py their FLOPs)."""

from __future__ import annotations

from .model import ModelShape

# Attention linears as (in, out, how TP splits them): "col" splits the output, "row" the input,
# "rep" is replicated on every TP rank.
_Linear = tuple[int, int, str]


def attention_linears(model: ModelShape) -> list[_Linear]:
    """One layer's attention projections, as Megatron-Core builds them.

    GQA: QKV (K and V narrowed to the query groups) column-parallel, the output row-parallel.
    MLA (MLASelfAttention, with the local layer spec the trainer builds): every projection
    is column-parallel but o_proj (heads·v → h, row-parallel): the down-projections to the
    query latent (q_a_proj, h → q_lora) and to the key/value latent plus the shared RoPE key
    (kv_a_proj_with_mqa, h → kv_lora + rope), whose outputs Megatron gathers over TP (Transformer
    Engine's spec would duplicate them instead), and the up-projections to the heads
    (q_b_proj: q_lora → heads·(nope + rope); kv_b_proj: kv_lora → heads·(nope + v)). Without
    a q_lora_rank, q_proj (h → heads·(nope + rope)) is column-parallel."""
    h, heads = model.hidden_size, model.num_attention_heads
    if not model.is_mla:
        hq, hkv = heads * model.kv_channels, model.num_query_groups * model.kv_channels
        return [(h, hq, "col"), (h, hkv, "col"), (h, hkv, "col"), (hq, h, "row")]
    assert model.kv_lora_rank is not None  # is_mla
    q_out = heads * model.qk_head_dim
    q = ([(h, model.q_lora_rank, "col"), (model.q_lora_rank, q_out, "col")]
         if model.q_lora_rank else [(h, q_out, "col")])
    return q + [(h, model.kv_lora_rank + model.qk_rope_head_dim, "col"),
                (model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim), "col"),
                (heads * model.v_head_dim, h, "row")]


def attention_weights(model: ModelShape) -> tuple[int, int]:
    """(TP-split, replicated) attention parameters of one layer, the latents' norms
    (q_a_layernorm, kv_a_layernorm) among the replicated."""
    split = sum(i * o for i, o, kind in attention_linears(model) if kind != "rep")
    replicated = sum(i * o for i, o, kind in attention_linears(model) if kind == "rep")
    if model.is_mla:
        replicated += (model.q_lora_rank or 0) + (model.kv_lora_rank or 0)
    return split, replicated


def attention_gemm_flops(model: ModelShape) -> int:
    """Forward FLOPs per token of one layer's attention projections, on one GPU times TP
    (each runs on every token over 1/TP of its width)."""
    return 2 * sum(i * o for i, o, _ in attention_linears(model))


def lora_attention(model: ModelShape, r: int, tp: int) -> int:
    """LoRA parameters of one layer's attention on one GPU: one (A, B) per HF module. On a
    column-parallel linear A is whole on every TP rank and B split; on a row-parallel one A
    is split and B whole; a replicated one keeps both."""
    if not model.is_mla:
        h, d = model.hidden_size, model.kv_channels
        hq, hkv = model.num_attention_heads * d, model.num_query_groups * d
        return r * 3 * h + r * (hq + 2 * hkv) // tp + r * hq // tp + r * h
    split = {"col": lambda i, o: r * i + r * o // tp, "row": lambda i, o: r * i // tp + r * o,
             "rep": lambda i, o: r * (i + o)}
    return sum(split[kind](i, o) for i, o, kind in attention_linears(model))


def mla_saved_elements(model: ModelShape) -> int:
    """Elements per token one MLA attention block keeps for backward (the caller's sum adds
    the norm input, the down-projections' shared input and the log-sum-exp). Assumed, after
    Megatron's MLASelfAttention with fused attention: the query latent (q_b_proj's input, 1
    element per q_lora) and its norm's input; the key/value latent with the RoPE key
    (kv_a_proj's output, its norm's input) and the normed latent (kv_b_proj's input); the
    up-projected Q and K (heads·(nope+rope) each: the RoPE key is copied to every head) and V
    (heads·v), which the attention kernel keeps; the attention output (heads·v, o_proj's
    input). mla_up_proj recompute frees Q, K and V (discarded_bytes_per_token)."""
    heads = model.num_attention_heads
    q_latent = 2 * (model.q_lora_rank or 0)
    kv_latent = (model.kv_lora_rank or 0) + model.qk_rope_head_dim + (model.kv_lora_rank or 0)
    return q_latent + kv_latent + mla_qkv_elements(model) + heads * model.v_head_dim


def mla_qkv_elements(model: ModelShape) -> int:
    """Elements per token of MLA's up-projected Q, K and V."""
    heads = model.num_attention_heads
    return 2 * heads * model.qk_head_dim + heads * model.v_head_dim
