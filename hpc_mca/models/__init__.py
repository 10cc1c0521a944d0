"""Model building blocks on top of Megatron-Core: Hugging Face models in, Hugging Face out.

This package imports nothing itself (so ``hpc_mca.models.hf_config`` and ``.checkpoint`` can be
used for cheap pre-checks); the heavy modules import torch and megatron.core when imported.

- ``hf_config``: ``read_hf_config`` parses config.json into an ``HFModelSpec`` (llama, mistral,
  qwen2, qwen3, qwen3_moe, mixtral) and refuses what it cannot reproduce.
- ``megatron_config``: ``transformer_config_kwargs``, ``layer_spec`` (local spec with a
  selectable core attention), ``rope_inv_freq``.
- ``norm``: ``TorchNorm``, the layer spec's torch norm that runs under TP sequence parallelism.
- ``mapping``: which slices of which HF tensors each Megatron parameter of a rank holds.
- ``checkpoint``: safetensors index/header pre-checks and per-slice reading.
- ``build``: ``build_model(source, ctx)`` -> this rank's GPTModel chunks, weights loaded.
- ``weights``: ``load_hf_weights``; ``export``: ``save_hf_checkpoint``.
- ``inference``: ``forward_logits`` through the pipeline schedule; ``thd_packed_seq_params``.
- ``attention``: core attention backends (TE / flash-attn / pure PyTorch with THD packing).
- ``errors``: ``ModelLoadError``.
- ``converters``: what a finetuning type (full, LoRA) changes: the model before training,
  the export, the resume record, dpo's reference (``converter_for(finetuning)``; no torch at
  import).
"""
