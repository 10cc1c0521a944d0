"""The ``data`` section of the run configuration (see :mod:`hpc_mca.config.sections`, which
re-exports it): what to train on and how samples become fixed-length rows. Kept in its own
module because it is the largest section; the rules that check it are in
:mod:`hpc_mca.config.rules`.

:class:`DataRun` is the little the data pipeline reads of the other sections; the config
builds it (``TrainConfig.data_run()``), so this layer never sees the whole run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from hpc_mca.frozen import Freezable

__all__ = ["DataArguments", "DataRun"]


@dataclass
class DataArguments(Freezable):
    """What to train on and how samples become fixed-length rows."""

    dataset: list[str] = field(default_factory=list)
    """Training files or directories: .jsonl/.json/.parquet/.arrow/.csv records (read through HF
    datasets, local only), Dataset.save_to_disk directories, or Megatron indexed data (path
    prefix of a .bin/.idx pair); with ``dataset_dir``, dataset_info.json names. A
    comma-separated string is split."""
    eval_dataset: list[str] | None = None
    """Evaluation files, same formats; None = none (or ``val_size`` held out of the train set)."""
    dataset_dir: str | None = None
    """LLaMA-Factory's dataset directory: when set, ``dataset`` and ``eval_dataset`` are names
    of entries in ``<dataset_dir>/dataset_info.json`` (file_name, formatting, ranking, columns,
    tags); None = they are paths."""
    mix_strategy: str = "concat"
    """Several training datasets: concat (one after the other), interleave_under (drawn by
    ``interleave_probs`` until the first runs out) or interleave_over (until all are seen)."""
    interleave_probs: list[float] | None = None
    """Interleave strategies: the chance of drawing from each training dataset, in order (sum
    1; a comma-separated string works too); None = in turn."""
    val_size: float = 0.0
    """Hold out this fraction (< 1) or count (>= 1) of the training samples for evaluation."""
    dataset_format: str = "auto"
    """auto (text for pt, alpaca or sharegpt by the first record's keys for sft), text,
    alpaca, sharegpt or indexed."""
    text_field: str = "text"
    """Field holding the document of a pt record."""
    template: str = "chat"
    """Chat template of sft/dpo samples: chat (the tokenizer's chat_template), plain (prompt +
    response + eos) or one of LLaMA-Factory's template names (``hpc_mca.data.templates``'s
    TEMPLATE_NAMES: qwen, llama3, ...), which also fix the tokenizer's eos, pad and stop words as
    LLaMA-Factory does (pt included; llama3 pt documents end with <|end_of_text|>)."""
    cutoff_len: int = 1024
    """sft/dpo: most tokens of one sample, as LLaMA-Factory counts them (before the causal
    shift, so ``cutoff_len - 1`` trained inputs): each turn gets what is left of it (an answer
    under half keeps all of it, else a prompt under half stays whole, else both shrink in
    proportion) and a cut sample is kept ("truncated N" in the data line). pt: inputs per
    piece after the shift; longer documents are split."""
    seq_length: int | None = None
    """Tokens per training row (packed or padded); None = ``cutoff_len``."""
    sequence_packing: bool = False
    """Pack several samples per row (best-fit decreasing, cu_seqlens per row) instead of
    padding each sample to a row of its own."""
    pack_alignment: int | None = None
    """Packed samples start at multiples of this many slots; None = 2·CP under context
    parallelism (which needs it), else 1. Rows hold other samples at another alignment, so a
    packed run that may move between CP sizes sets the largest 2·CP here (e.g. 4 for CP1 and
    CP2) and keeps it; a resume with another alignment is refused."""
    pt_chunking: str = "concat"
    """pt only: concat (join documents with eos and cut rows of ``cutoff_len``) or document
    (every document on its own, long ones split)."""
    train_on_prompt: bool = False
    """sft: also train on prompt tokens (default: loss on responses only); refused with an
    efficient_eos template (glm4), as in LLaMA-Factory."""
    mask_history: bool = False
    """sft: train on the last answer only; the cutoff_len budget goes to the last turn first
    (earlier turns keep what is left) and, for reasoning templates, earlier answers lose their
    thoughts (LLaMA-Factory's mask_history)."""
    enable_thinking: bool | None = True
    """Reasoning templates (qwen3, ...): True = answers keep their thought block (an empty one
    is added where there is none and not trained on), False = an empty thought is written into
    the prompt, None = answers as written (LLaMA-Factory's enable_thinking)."""
    default_system: str | None = None
    """System prompt for conversations without one, replacing the template's default; None =
    the template's own."""
    tool_format: str | None = None
    """How tool definitions and calls are written (LLaMA-Factory's tool formats: default,
    glm4, llama3, mistral, qwen, ...); None = the template's own."""
    image_max_pixels: int = 768 * 768
    """Vision-language templates: an image with more pixels is scaled down (aspect kept) to this
    many before the processor sees it (LLaMA-Factory's key and default)."""
    image_min_pixels: int = 32 * 32
    """Vision-language templates: an image with fewer pixels is scaled up to this many
    (LLaMA-Factory's key and default)."""
    media_dir: str | None = None
    """Where relative image paths of the records are looked up first; None = ``dataset_dir``
    (a dataset given as a path: its file's directory). A path not found there is read as
    written (LLaMA-Factory's rule)."""
    preprocessing_num_workers: int | None = None
    """Tokenize sft/dpo records in this many processes (consecutive chunks, put back in order:
    the samples equal one process's byte for byte); None = one."""
    max_samples: int | None = None
    """Keep at most this many records per dataset file (for quick runs)."""
    preprocessing_cache_dir: str | None = None
    """Where tokenized datasets are cached; None = $HPC_MCA_CACHE_DIR or ~/.cache/hpc_mca."""
    overwrite_cache: bool = False
    """Tokenize again even when a cached copy exists."""
    data_path: list[str] | None = None
    """pt only, instead of ``dataset``: Megatron's ``--data-path``, a blend of indexed corpora
    (.bin/.idx prefixes) as weight/prefix pairs (``[0.7, prefixA, 0.3, prefixB]`` or the string
    ``"0.7 prefixA 0.3 prefixB"``) or prefixes alone (equal weights), built with megatron-core's
    BlendedMegatronDatasetBuilder: ``max_steps × global_batch_size`` windows of seq_length+1
    tokens drawn in those weights (needs ``training.max_steps``; a different max_steps, seed or
    seq_length is a different blend). Its indices are cached under ``preprocessing_cache_dir``,
    else the run directory (``megatron_indices/``). None = use ``dataset``."""
    split: str | None = None
    """With ``data_path``: Megatron's ``--split``, the train,valid,test shares of each corpus's
    documents (e.g. ``"969,30,1"``); None = ``"100,0,0"`` (no evaluation). A validation share
    gives eval samples drawn from the held-out documents in the same weights: ``val_size`` of
    them (a count, or a fraction of the train samples), else one evaluation step's worth."""


@dataclass(frozen=True)
class DataRun:
    """What the data pipeline needs from the sections it does not own (finetuning, model,
    training, parallel), as a resolved config states it. Built by ``TrainConfig.data_run()``;
    data sits below the config package and must not read the whole config."""

    stage: str
    """finetuning.stage: which tokenization, rows and held-out split the samples get."""
    seed: int
    """training.seed: data order, held-out split, mixing and the blend's draw."""
    seq_length: int
    """Tokens per row (data.seq_length as resolve derives it: else data.cutoff_len)."""
    global_batch_size: int
    """training.global_batch_size (derived by resolve): rows per optimizer step."""
    tokenizer_path: str = ""
    """model.tokenizer_name_or_path, else model.model_name_or_path: the tokenizer to load
    when the caller passes none."""
    output_dir: str = ""
    """training.output_dir: where a blend's indices are cached without a preprocessing cache."""
    micro_batch_size: int = 1
    """training.per_device_train_batch_size: rows per training micro-batch on one rank."""
    eval_batch_size: int = 8
    """training.per_device_eval_batch_size: rows per evaluation micro-batch on one rank."""
    max_steps: int = -1
    """training.max_steps: a blend draws ``max_steps × global_batch_size`` training samples."""
    data_parallel_size: int = 1
    """parallel.data_parallel_size (derived by resolve): ranks that read different rows."""
    context_parallel_size: int = 1
    """parallel.context_parallel_size: packed samples start at multiples of 2·CP."""
    num_workers: int = 0
    """training.dataloader_num_workers: worker processes of each DataLoader (0 = none)."""
    prefetch_factor: int | None = None
    """training.dataloader_prefetch_factor: micro-batches each worker prepares ahead (None:
    torch's default)."""
