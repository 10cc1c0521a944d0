"""Token ids and training targets for pt documents and sft conversations.

The causal label shift happens here and nowhere else (:func:`causal_shift`): a sample of
``n`` tokens becomes ``n - 1`` inputs ``tokens[:-1]`` and labels ``labels[t] = tokens[t + 1]``
(``IGNORE_INDEX`` where the next token is not trained on). Shifting each sample on its own
means a packed row never asks a document's last token to predict the next document's first,
and packed and padded rows hold the very same (input, label) pairs.

sft conversations are rendered with the tokenizer's chat template (``template: chat``) or
concatenated (``template: plain``); the response spans are found as character ranges of the
rendered text (render the conversation up to each assistant turn with and without it) and
mapped onto tokens with the fast tokenizer's offsets, so merges across a span boundary cannot
shift the mask.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .errors import DataError

IGNORE_INDEX = -100
PT_CHUNKINGS = ("concat", "document")
"""``data.pt_chunking``: one stream of all documents, or each document on its own."""
"""Label of a position without loss (padding, prompts), as in transformers."""
_BATCH = 512


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of everything that changes token ids: vocabulary, rules, template, specials."""
    parts = [type(tokenizer).__name__, tokenizer.backend_tokenizer.to_str(),
             str(getattr(tokenizer, "chat_template", None)),
             repr((tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id))]
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16).hexdigest()


def eos_id(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; documents and responses need one")
    return int(tokenizer.eos_token_id)


def pad_id(tokenizer: Any) -> int:
    """Id written into padding slots (never trained on): pad, else eos."""
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
               else eos_id(tokenizer))


def causal_shift(tokens: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)`` of one sample: the single place labels are shifted."""
    labels = np.where(trained[1:], tokens[1:], IGNORE_INDEX)
    return tokens[:-1].astype(np.int32), labels.astype(np.int32)


# --- pt ------------------------------------------------------------------------------------


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> Iterator[np.ndarray]:
    """Token ids of each document with eos appended."""
    eos = eos_id(tokenizer)
    for start in range(0, len(texts), _BATCH):
        batch = tokenizer(list(texts[start:start + _BATCH]), add_special_tokens=False)
        for ids in batch["input_ids"]:
            yield np.asarray(list(ids) + [eos], dtype=np.int32)


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


# --- sft -----------------------------------------------------------------------------------


def render(tokenizer: Any, messages: list[dict[str, str]], template: str,
           train_on_prompt: bool, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character spans that carry loss."""
    if template == "chat":
        text, spans = _render_chat(tokenizer, messages, where)
    elif template == "plain":
        text, spans = _render_plain(tokenizer, messages)
    else:
        raise DataError(f"data.template={template!r} is not valid; valid: chat, plain")
    return text, ([(0, len(text))] if train_on_prompt else spans)


def _render_chat(tokenizer: Any, messages: list[dict[str, str]],
                 where: str) -> tuple[str, list[tuple[int, int]]]:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("data.template='chat' but the tokenizer has no chat_template; "
                        "valid: plain, or a tokenizer with a chat template")
    def chat(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                             add_generation_prompt=prompt)

    text = chat(len(messages), False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = chat(index, True), chat(index + 1, False)
        if not (after.startswith(before) and text.startswith(after)):
            raise DataError(f"{where}: the chat template does not render turn {index + 1} as "
                            "a prefix of the whole conversation, so its response tokens "
                            "cannot be located; valid: a prefix-stable template, or plain")
        spans.append((len(before), len(after)))
    return text, spans


Spans = list[tuple[int, int]]


def _render_plain(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, Spans]:
    eos = tokenizer.eos_token or ""
    text, spans = "", []
    for message in messages:
        if message["role"] == "assistant":
            spans.append((len(text), len(text) + len(message["content"]) + len(eos)))
            text += message["content"] + eos
        else:
            text += message["content"] + ("\n" if message["role"] == "system" else "")
    return text, spans


def encode_rendered(tokenizer: Any, rendered: Sequence[tuple[str, list[tuple[int, int]]]]
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(tokens, trained)`` per rendered conversation: a token is trained when its first
    character lies in a loss span."""
    for start in range(0, len(rendered), _BATCH):
        chunk = rendered[start:start + _BATCH]
        batch = tokenizer([text for text, _ in chunk], add_special_tokens=False,
                          return_offsets_mapping=True)
        for (_, spans), ids, offsets in zip(chunk, batch["input_ids"], batch["offset_mapping"]):
            first = np.asarray([o[0] for o in offsets], dtype=np.int64)
            trained = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                trained |= (first >= lo) & (first < hi)
            yield np.asarray(ids, dtype=np.int32), trained


def sft_sample(tokens: np.ndarray, trained: np.ndarray,
               cutoff_len: int) -> tuple[tuple[np.ndarray, np.ndarray] | None, bool]:
    """The shifted sample cut to ``cutoff_len`` inputs, and whether it was truncated; None when
    nothing trainable is left."""
    truncated = len(tokens) > cutoff_len + 1
    tokens, trained = tokens[:cutoff_len + 1], trained[:cutoff_len + 1]
    input_ids, labels = causal_shift(tokens, trained)
    if not (labels != IGNORE_INDEX).any():
        return None, truncated
    return (input_ids, labels), truncated
