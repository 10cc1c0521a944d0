"""Token ids and training targets for pt documents and sft conversations.

The causal label shift happens here and nowhere else (:func:`causal_shift`): a sample of
``n`` tokens becomes ``n - 1`` inputs ``tokens[:-1]`` and labels ``labels[t] = tokens[t + 1]``
(``IGNORE_INDEX`` where the next token is not trained on). Shifting each sample on its own
means a packed row never asks a document's last token to predict the next document's first,
and packed and padded rows hold the very same (input, label) pairs.

sft and dpo samples are built by :mod:`.samples` (LLaMA-Factory's processors, with the templates
of :mod:`.templates`) and shifted here.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .choices import PT_CHUNKINGS
from .errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label of a position without loss (padding, prompts), as in transformers."""
_BATCH = 512


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """A fast tokenizer from a local directory (never downloads)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise DataError(f"model.tokenizer_name_or_path={str(path)!r} is not a local directory "
                        "(tokenizers are never downloaded)")
    tokenizer = AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"model.tokenizer_name_or_path={str(path)!r} loads a slow tokenizer; "
                        "a fast one (tokenizer.json) is needed for offset mapping")
    return tokenizer


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of everything that changes token ids: vocabulary, rules, template, specials."""
    parts = [type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(),
             str(getattr(tokenizer, "chat_template", None)),
             repr((tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id))]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; documents and responses need one")
    return int(tokenizer.eos_token_id)


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Id written into padding slots (never trained on): pad, else eos."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
               else eos_id(tokenizer))


def causal_shift(tokens: np.ndarray, trained: np.ndarray,
                 targets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)`` of one sample: the single place labels are shifted. A trained
    position's label is its token, or ``targets`` there when given (an efficient_eos template
    trains eos where the next turn's first prompt token stands)."""
    wanted = tokens if targets is None else targets
    labels = np.where(trained[1:], wanted[1:], IGNORE_INDEX)
    return tokens[:-1].astype(np.int32), labels.astype(np.int32)


# --- pt ------------------------------------------------------------------------------------


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str],
                     end: int | None = None) -> Iterator[np.ndarray]:
    """Token ids of each document with ``end`` (default: eos) appended and, for a tokenizer
    that adds a bos (``add_bos_token``), the bos first, as LLaMA-Factory's pretraining
    processor writes an unpacked document."""
    eos = eos_id(tokenizer) if end is None else end
    bos = [int(tokenizer.bos_token_id)] if getattr(tokenizer, "add_bos_token", False) and \
        tokenizer.bos_token_id is not None else []
    for start in range(0, len(texts), _BATCH):
        batch = tokenizer(list(texts[start:start + _BATCH]), add_special_tokens=False)
        for ids in batch["input_ids"]:
            yield np.asarray(bos + list(ids) + [eos], dtype=np.int32)


def windows(length: int, cutoff_len: int) -> list[tuple[int, int]]:
    """``(start, end)`` token ranges of ``cutoff_len + 1`` tokens, overlapping by one token so
    that every token is predicted once; a shorter last window is kept if it has 2+ tokens."""
    spans = []
    for start in range(0, max(length - 1, 0), cutoff_len):
        spans.append((start, min(start + cutoff_len + 1, length)))
    return spans


def pt_samples(documents: Sequence[np.ndarray], cutoff_len: int,
               chunking: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shifted ``(input_ids, labels)`` samples: ``concat`` cuts one stream of all documents,
    ``document`` cuts each document on its own (a document never shares a sample)."""
    if chunking == "concat":
        documents = [np.concatenate(documents)] if len(documents) else []
    elif chunking != "document":
        raise DataError(f"data.pt_chunking={chunking!r} is not valid; valid: "
                        + ", ".join(PT_CHUNKINGS))
    for tokens in documents:
        for start, end in windows(len(tokens), cutoff_len):
            piece = tokens[start:end]
            yield causal_shift(piece, np.ones(len(piece), dtype=bool))
