"""Preference pairs for stage dpo: records to chosen/rejected samples, and rows that keep the
two answers of a pair together.

Records use LLaMA-Factory's pairwise formats:

* alpaca: ``instruction`` (optional ``input``, ``system``, ``history``), ``chosen`` and
  ``rejected`` as strings;
* sharegpt: ``conversations`` (or ``messages``) ending with a user turn, ``chosen`` and
  ``rejected`` as one assistant turn each (``{"from", "value"}`` or ``{"role", "content"}``),
  optional ``system``.

A pair becomes two shifted samples, chosen at index ``2p`` and rejected at ``2p + 1``. Both
start with the same prompt tokens, and only the final answer carries labels: the prompt is
everything before it (system prompt, earlier turns of the history, assistant ones included,
and the last user turn), as TRL's DPOTrainer and LLaMA-Factory score a pair. An empty answer
is scored on what the template renders for it (its end-of-turn token), as TRL does; an answer
with no token of its own is refused. When prompt plus the longer response exceed
``cutoff_len``, the prompt (kept from its start) and both responses are cut with one split, so
the two samples still share their prompt (see :func:`split_budget`).

Rows keep pairs whole. Unpacked, each sample is a row, and a sampling unit is a pair: a
micro-batch of ``per_device_train_batch_size`` pairs holds rows ``[c1, r1, c2, r2, ...]``.
Packed, whole pairs go into rows as neighbouring documents, and the unit is a packed row. In
both cases the documents of a micro-batch alternate chosen, rejected.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from .batch import PackedBatch, collate_batch
from .errors import DataError
from .packing import aligned, best_fit_decreasing
from .records import Record, _alpaca, _sharegpt, _turn, detect_sft_format
from .rows import RowDataset
from .store import SampleStore, Samples
from .tokenize import causal_shift, encode_rendered, render

Messages = list[dict[str, str]]


def preference_of(record: Record, fmt: str) -> tuple[Messages, str, str]:
    """(prompt messages, chosen text, rejected text) of a pairwise record."""
    data = record.data
    missing = [key for key in ("chosen", "rejected") if key not in data]
    if missing:
        raise DataError(f"{record.where}: a preference pair needs 'chosen' and 'rejected'; "
                        f"missing {', '.join(map(repr, missing))} (keys: {sorted(data)})")
    if fmt == "alpaca":
        prompt = _alpaca(Record(record.where, {**data, "output": ""}))[:-1]
        answers = [_answer(record, key, {"role": "assistant", "content": data[key]})
                   for key in ("chosen", "rejected")]
    elif fmt == "sharegpt":
        prompt = _sharegpt(record)
        if prompt[-1]["role"] != "user":
            raise DataError(f"{record.where}: a pairwise conversation must end with a user turn "
                            f"(the answers are 'chosen' and 'rejected'); it ends with "
                            f"{prompt[-1]['role']!r}")
        answers = [_answer(record, key, data[key]) for key in ("chosen", "rejected")]
    else:
        raise DataError(f"data.dataset_format={fmt!r} is not a pairwise format; valid: "
                        "alpaca, sharegpt")
    return prompt, answers[0], answers[1]


def _answer(record: Record, key: str, turn: Any) -> str:
    role, content = _turn(record, turn)
    if role != "assistant":
        raise DataError(f"{record.where}: {key!r} must be an assistant turn, got role {role!r}")
    return content


def split_budget(prompt: int, response: int, budget: int) -> tuple[int, int]:
    """Tokens of prompt and response to keep when ``prompt + response`` exceeds ``budget``.

    LLaMA-Factory's rule: a response under half the budget is kept whole; otherwise a prompt
    under half the budget is kept whole and the response gets the rest; otherwise both shrink in
    proportion to their lengths.
    """
    if prompt + response <= budget:
        return prompt, response
    if 2 * response < budget:
        keep = response
    elif 2 * prompt < budget:
        keep = budget - prompt
    else:
        keep = int(budget * response / (prompt + response))
    keep = min(keep, response)
    return min(max(budget - keep, 0), prompt), keep


def pair_samples(chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray],
                 cutoff_len: int, where: str
                 ) -> tuple[list[tuple[np.ndarray, np.ndarray]] | None, bool]:
    """The two shifted samples of one pair from their ``(tokens, trained)``, cut to
    ``cutoff_len`` inputs each; None when an answer has nothing trainable left. Also whether
    anything was cut."""
    for side, (_, trained) in zip(("chosen", "rejected"), (chosen, rejected)):
        if not trained.any():
            # TRL would score it as log-probability 0 (no tokens), which compares nothing.
            raise DataError(f"{where}: the {side} answer has no token of its own to score "
                            "(empty, and the template adds no end-of-turn token after it); "
                            "valid: a non-empty answer, or a template that ends turns with eos")
    starts = [int(np.argmax(trained)) for _, trained in (chosen, rejected)]
    prompt_len = starts[0]
    if starts[0] != starts[1] or not np.array_equal(chosen[0][:prompt_len],
                                                    rejected[0][:prompt_len]):
        raise DataError(f"{where}: chosen and rejected do not tokenize to the same prompt "
                        "tokens (the chat template changes the prompt with the answer)")
    longest = max(len(chosen[0]), len(rejected[0])) - prompt_len
    keep_prompt, keep_answer = split_budget(prompt_len, longest, cutoff_len + 1)
    out = []
    for tokens, trained in (chosen, rejected):
        cut = np.r_[np.arange(keep_prompt), prompt_len + np.arange(min(keep_answer,
                                                                       len(tokens) - prompt_len))]
        if not trained[cut].any():
            return None, True
        out.append(causal_shift(tokens[cut], trained[cut]))
    return out, keep_prompt < prompt_len or keep_answer < longest


def tokenize_pairs(records: list[Record], tokenizer: Any, data: Any) -> SampleStore:
    """Shifted samples of pairwise records, chosen and rejected interleaved."""
    fmt = data.dataset_format
    if fmt == "auto" and records:
        fmt = detect_sft_format(records[0])
    rendered = []
    for record in records:
        prompt, chosen, rejected = preference_of(record, fmt)
        for answer in (chosen, rejected):
            text, spans = render(tokenizer, [*prompt, {"role": "assistant", "content": answer}],
                                 data.template, False, record.where)
            # render marks every assistant turn; the earlier ones are history, part of the
            # prompt the two answers share, which TRL and LLaMA-Factory never score.
            rendered.append((text, spans[-1:]))
    encoded = list(encode_rendered(tokenizer, rendered))
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    truncated = dropped = 0
    for index, record in enumerate(records):
        pair, cut = pair_samples(encoded[2 * index], encoded[2 * index + 1], data.cutoff_len,
                                 record.where)
        truncated += cut
        if pair is None:
            dropped += 1
        else:
            samples += pair
    return SampleStore.from_samples(samples, {"pairs": len(samples) // 2, "records": len(records),
                                              "truncated": truncated, "dropped": dropped})


def check_pairwise(record: Record) -> None:
    """DataError (one line) when a dpo dataset's first record is not a pair."""
    if "chosen" not in record.data or "rejected" not in record.data:
        raise DataError(f"{record.where}: finetuning.stage='dpo' needs pairwise records "
                        f"('chosen' and 'rejected' answers); this one has keys "
                        f"{sorted(record.data)}")


class PairRows(RowDataset):
    """Unpacked pairs: every sample is a row and a sampling unit is a pair of rows."""

    def __len__(self) -> int:
        return len(self.rows) // 2

    def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:  # type: ignore[override]
        return [RowDataset.__getitem__(self, 2 * index), RowDataset.__getitem__(self, 2 * index + 1)]

    @staticmethod
    def collate(items: Sequence[list[dict[str, torch.Tensor]]]) -> PackedBatch:
        return collate_batch([row for pair in items for row in pair])


def pair_rows(samples: Samples, seq_length: int, pad_token_id: int, *, packed: bool,
              align: int) -> RowDataset:
    """Rows that keep every pair (samples ``2p``, ``2p + 1``) in one micro-batch."""
    if not packed:
        return PairRows(samples, seq_length, pad_token_id, packed=False)
    lengths = samples.lengths
    slots = [aligned(int(lengths[2 * p]), align) + aligned(int(lengths[2 * p + 1]), align)
             for p in range(len(samples) // 2)]
    rows = [[i for p in sorted(row) for i in (2 * p, 2 * p + 1)]
            for row in best_fit_decreasing(slots, seq_length)]
    return RowDataset(samples, seq_length, pad_token_id, packed=True, align=align, rows=rows)


def split_pairs(samples: Samples, val_size: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample indices of the train and held-out pairs (``data.val_size`` counts pairs)."""
    pairs = len(samples) // 2
    n_val = int(val_size) if val_size >= 1 else max(1, round(val_size * pairs))
    if n_val >= pairs:
        raise DataError(f"data.val_size={val_size} leaves no training pairs out of {pairs}")
    order = np.random.default_rng(seed).permutation(pairs)

    def expand(chosen: np.ndarray) -> np.ndarray:
        return np.stack([2 * chosen, 2 * chosen + 1], axis=1).reshape(-1)

    return expand(np.sort(order[n_val:])), expand(np.sort(order[:n_val]))
