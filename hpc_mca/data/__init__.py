"""Training data: records -> tokenized, shifted samples -> packed or padded rows -> loaders.

Modules, in pipeline order:

* :mod:`.records` - dataset files to records (through :mod:`.tables`, HF datasets, local
  only).
* :mod:`.sources` - direct paths or LLaMA-Factory dataset_info.json entries (columns, tags).
* :mod:`.mix` - several training datasets concatenated or interleaved by probability.
* :mod:`.conversation` - alpaca/sharegpt records to LLaMA-Factory's examples (converter rules).
* :mod:`.templates` - LLaMA-Factory's chat templates (and chat, plain); they fix the tokenizer.
* :mod:`.samples` - examples to sft samples and dpo pairs (LLaMA-Factory's processors).
* :mod:`.encode` - records to shifted samples, in one process or several.
* :mod:`.tokenize` - the tokenizer, pt documents and pieces, the one causal shift.
* :mod:`.store` - samples in flat arrays, the tokenization cache, Megatron indexed corpora.
* :mod:`.packing` - best-fit-decreasing packing and its efficiency (no torch).
* :mod:`.rows` - fixed-length rows (cu_seqlens when packed) and micro-batch collation.
* :mod:`.batch` - :class:`~.batch.PackedBatch`, a collated micro-batch as one value, and its
  context-parallel shard (the mirrored 2·CP-chunk layout).
* :mod:`.sampler` - seed-ordered, data-parallel, resumable sample order (no torch).
* :mod:`.arguments` - the config's ``data`` section, and :class:`~.arguments.DataRun`, the
  little the pipeline reads of the other sections (built by ``TrainConfig.data_run()``).
* :mod:`.dataset` - the whole pipeline from the data section and that view.
* :mod:`.masks` - causal masks, position ids and packed sequence lengths.
* :mod:`.addition` - the demo task (multi-digit addition) and its exact-match metric.

This package itself imports nothing so that ``import hpc_mca.data`` stays cheap; rows, batch,
dataset, masks and addition import torch when imported.
"""
