"""Unpaired feedback for stage kto: records with a boolean ``kto_tag`` to samples, and rows
that put each example's KL row beside it.

Records are LLaMA-Factory's kto data: an sft record (alpaca, or sharegpt ending on the
answer) plus ``kto_tag`` (a dataset_info entry's ``columns.kto_tag``), true for a desirable
answer, false for an undesirable one. The answer is encoded as LLaMA-Factory's feedback
processor does: ``encode_oneturn`` of the prompt turns plus the answer, an ``efficient_eos``
template's eos appended to the answer, prompt and answer cut by one ``infer_seqlen`` split of
``cutoff_len``; only the answer carries labels.

**The KL row** of an example is its own prompt with another example's answer (the mismatched
pair KTO estimates its KL term from), cut by its own ``infer_seqlen`` split. Which answer is
TRL's choice, not LLaMA-Factory's (which rotates within its preprocessing batches of the
file): TRL's ``KTOTrainer`` rotates the answers by one within each micro-batch as served
(example ``i`` gets the answer of example ``i-1``, the first the last's). Here the rotation
runs over the *micro-step*: the ``micro_batch_size × data-parallel size`` examples every rank
trains at once, in the sampler's global order (:class:`MicroStepPairs`). On one rank that is
TRL's micro-batch; over several it is the set TRL pools its KL estimate over, and the pairs
do not depend on how the micro-step is split over ranks (DP2 pairs as one process with twice
the micro-batch). A micro-step of one example would pair it with itself (the KL estimate its
own reward): the config rules refuse it, as TRL does. A micro-batch of ``B`` examples is
``2B`` rows: answer, KL row, answer, KL row, ...

**The store** keeps every example as two samples, unshifted and uncut so the KL row can be
made from any pair: sample ``2i`` is the prompt's token ids, and its labels hold the example's
tag (1 desirable, 0 undesirable) in every slot; sample ``2i + 1`` is the answer's token ids
(labels = the ids). Mixing, held-out splits and the sampler move the two together
(``rows_per_example`` 2). Packed rows are refused for kto (config rules).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from .batch import PackedBatch, collate_batch
from .conversation import Example, example_of
from .encode import conversation_format, prepare_template
from .errors import DataError
from .multimodal import check_no_images
from .packing import PackingReport
from .records import Record
from .rows import RowDataset
from .sampler import DataSampler
from .samples import infer_seqlen, is_supervised
from .store import Samples, SampleStore
from .tokenize import IGNORE_INDEX, causal_shift

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .arguments import DataArguments
    from .templates import Template

TAG = "kto_tag"
"""The record field of the feedback (a dataset_info entry's ``columns.kto_tag`` maps onto it)."""


def tokenize_feedback(records: list[Record], tokenizer: PreTrainedTokenizerBase, data: DataArguments) -> SampleStore:
    """Prompt and answer samples of kto records (see the module docstring), with the counts
    the data line reports: records, samples (examples), desirable, invalid, truncated."""
    fmt = conversation_format(records, data, feedback=True)
    template = prepare_template(tokenizer, data)
    counts: Counter[str] = Counter(records=len(records), invalid=0, truncated=0, desirable=0)
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    for record in records:
        tag = feedback_tag(record)
        example = example_of(record, fmt, False)
        if example is None or not is_supervised(example):
            counts["invalid"] += 1  # LLaMA-Factory drops it with a warning
            continue
        check_no_images(example, template, "images train with finetuning.stage 'sft' or 'dpo' only")
        prompt, answer = feedback_parts(template, tokenizer, example)
        kept = infer_seqlen(len(prompt), len(answer), data.cutoff_len)
        counts["truncated"] += kept != (len(prompt), len(answer))
        counts["desirable"] += tag
        samples.append((np.asarray(prompt, dtype=np.int32), np.full(len(prompt), int(tag), np.int32)))
        samples.append((np.asarray(answer, dtype=np.int32), np.asarray(answer, dtype=np.int32)))
    counts["samples"] = len(samples) // 2
    return SampleStore.from_samples(samples, dict(counts))


def feedback_tag(record: Record) -> bool:
    """The record's ``kto_tag``: a boolean, else a one-line DataError."""
    tag = record.data.get(TAG)
    if not isinstance(tag, bool):
        raise DataError(f"{record.where}: finetuning.stage='kto' needs a boolean {TAG} (true = "
                        f"desirable answer), got {tag!r:.40}")
    return tag


def feedback_parts(template: Template, tokenizer: PreTrainedTokenizerBase,
                   example: Example) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a valid example, uncut: LLaMA-Factory's feedback encoding."""
    prompt, answer = template.encode_oneturn(tokenizer, example.prompt + example.response,
                                             example.system or None, example.tools or None)
    answer = list(answer)
    if template.efficient_eos:
        answer.append(tokenizer.eos_token_id)
    return list(prompt), answer


class FeedbackRows(RowDataset):
    """kto rows: a sampling unit is an example; :meth:`collate` makes its answer row and its
    KL row (the micro-step's rotation, :class:`MicroStepPairs`)."""

    def __init__(self, samples: Samples, seq_length: int, pad_token_id: int, *,
                 cutoff_len: int) -> None:
        self.cutoff_len = min(cutoff_len, seq_length + 1)  # a shifted row is one shorter
        super().__init__(samples, seq_length, pad_token_id, packed=False,
                         rows=[[i] for i in range(len(samples))])

    def _check_rows(self) -> None:
        """Rows are cut at collation (infer_seqlen), so any sample length fits."""

    def __len__(self) -> int:
        return len(self.samples) // 2

    @property
    def report(self) -> PackingReport:
        """Real tokens / slots of the examples' answer rows, as :meth:`_row` cuts them (the
        samples are prompts and answers apart, each longer than a row may hold, so the
        default count over samples would exceed the slots; KL rows repeat these tokens)."""
        lengths = self.samples.lengths
        real = 0
        for example in range(len(self)):
            keep = infer_seqlen(int(lengths[2 * example]), int(lengths[2 * example + 1]), self.cutoff_len)
            real += max(sum(keep) - 1, 0)  # the causal shift drops one token
        return PackingReport(num_samples=len(self), num_rows=len(self), real_tokens=real,
                             seq_length=self.seq_length)

    def __getitem__(self, index: tuple[int, int]  # type: ignore[override]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(prompt, answer, KL answer, tag) of example ``index[0]`` whose KL row takes the
        answer of example ``index[1]``."""
        own, other = index
        prompt, tags = self.samples.sample(2 * own)
        answer, _ = self.samples.sample(2 * own + 1)
        mismatched, _ = self.samples.sample(2 * other + 1)
        return prompt, answer, mismatched, int(tags[0]) if len(tags) else 0

    def batch_sampler(self, sampler: DataSampler) -> MicroStepPairs:
        """The data loaders' sampler, each index paired with its KL answer's example."""
        return MicroStepPairs(sampler)

    def collate(self, items: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int]]) -> PackedBatch:
        """Rows answer_1, KL_1, answer_2, KL_2, ...; ``tags`` [B] (1 desirable)."""
        rows = []
        for prompt, answer, mismatched, _ in items:
            rows += [self._row(prompt, answer), self._row(prompt, mismatched)]
        batch = collate_batch(rows)
        tags = torch.tensor([item[3] for item in items], dtype=torch.int64)
        return PackedBatch(**{**vars(batch), "tags": tags})

    def _row(self, prompt: np.ndarray, answer: np.ndarray) -> dict[str, torch.Tensor]:
        keep_prompt, keep_answer = infer_seqlen(len(prompt), len(answer), self.cutoff_len)
        tokens = np.concatenate([prompt[:keep_prompt], answer[:keep_answer]]).astype(np.int64)
        trained = np.arange(len(tokens)) >= keep_prompt
        ids, labels = causal_shift(tokens, trained)
        size, n = self.seq_length, len(ids)
        if n > size:
            raise DataError(f"a kto row of {n} tokens exceeds data.seq_length={size}; valid: "
                            "seq_length at least cutoff_len - 1")
        input_ids = np.full(size, self.pad_token_id, dtype=np.int64)
        row_labels = np.full(size, IGNORE_INDEX, dtype=np.int64)
        input_ids[:n], row_labels[:n] = ids, labels
        positions = np.arange(size, dtype=np.int64)  # as RowDataset: padding runs on
        row = {"input_ids": input_ids, "labels": row_labels,
               "loss_mask": (row_labels != IGNORE_INDEX).astype(np.float32),
               "attention_mask": (np.arange(size) < n).astype(np.int64), "position_ids": positions}
        return {key: torch.from_numpy(value) for key, value in row.items()}


class MicroStepPairs:
    """A :class:`~hpc_mca.data.sampler.DataSampler`'s micro-batches as ``(example, example
    whose answer its KL row takes)``: the micro-step's examples in global order, rotated by
    one (see the module docstring)."""

    def __init__(self, sampler: DataSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        plain = self.sampler
        for step in plain.micro_steps():  # the sampler's micro-steps; its micro-batch is step[mine]
            mine = plain.rank_slice(step)
            yield [(int(i), int(j)) for i, j in zip(step[mine], np.roll(step, 1)[mine])]

    def __len__(self) -> int:
        return len(self.sampler)


def feedback_rows(samples: Samples, seq_length: int, pad_token_id: int, *, packed: bool,
                  align: int, cutoff_len: int) -> RowDataset:
    """:class:`FeedbackRows` of kto samples (``packed`` is refused by the config rules)."""
    if packed:
        raise DataError("data.sequence_packing=true does not work with finetuning.stage='kto' "
                        "(each micro-batch builds its KL rows); valid: sequence_packing false")
    return FeedbackRows(samples, seq_length, pad_token_id, cutoff_len=cutoff_len)
