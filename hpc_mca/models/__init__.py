"""Model building blocks on top of Megatron-Core: Hugging Face models in, Hugging Face out.

This package imports nothing itself (so ``hpc_mca.models.hf_config`` and ``.checkpoint`` can be
used for cheap pre-checks); the heavy modules import torch and megatron.core when imported.

- ``hf_config``: ``read_hf_config`` parses config.json into an ``HFModelSpec`` (llama, mistral,
  qwen2, qwen3, qwen3_moe, mixtral, seed_oss) and refuses what it cannot reproduce.
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
- ``gpt``: ``McaGPTModel``, the chunk class (GPTModel with the model methods scripts call).
- ``lora_peft``: a script's own peft LoRA on a chunk (``get_peft_model``), as the run config's.

``AutoConfig`` and ``AutoModel`` are importable from here, where mcore_adapter's scripts import
them (``from hpc_mca.models import AutoConfig, AutoModel``); they are the Python API's
(:mod:`hpc_mca.api.model`), loaded on first use, so that this package itself still imports
nothing.
"""

from typing import Any

_API_NAMES = ("AutoConfig", "AutoModel")


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        import hpc_mca.api.model as api  # a facade: mcore_adapter's import path (see above)

        return getattr(api, name)
    raise AttributeError(f"module 'hpc_mca.models' has no attribute {name!r}")
