"""A script's collator: its padded micro-batches as the trainer's rows, read one way.

A collator gets the examples of a micro-batch and returns ``[B, S]`` tensors: ``input_ids``,
``labels`` (-100 where nothing trains) and optionally ``attention_mask`` (1 on real tokens) and
``position_ids``. Two label conventions are in use, and each batch says which it follows:

* **aligned** (transformers', LLaMA-Factory's collators): ``labels[t]`` is the token at ``t``;
  the trainer shifts them once (``targets[t] = labels[t + 1]``; the last slot trains nothing);
* **pre-shifted** (ROLL's ``data_collator_wrapper``, Megatron's own): the collator dropped the
  last input token and the first label, so ``labels[t]`` is the target of input ``t``; the
  trainer takes them as they are.

Where a label trains, it equals ``input_ids[t]`` in the first and ``input_ids[t + 1]`` in the
second; the first batches (:meth:`CollatedRows.probe`, on every rank alike before training)
settle which, every later batch must keep to it, and a batch that matches neither, or a
collator whose first batches fit both, is refused in one line. So a convention is never
applied twice, and a ROLL script with its wrapper trains the numbers a YAML run does.

Pair stages (dpo, orpo, simpo) take LLaMA-Factory's, ROLL's and TRL's layout: the ``B`` chosen
rows, then their ``B`` rejected rows in the same order (``PairwiseDataCollatorWithPadding``);
row ``i`` and row ``B + i`` are a pair. ROLL's wrapper trims ``attention_mask`` but not
``chosen_attention_mask``, so a pre-shifted pair batch may carry a mask one slot wider than
its inputs: it is read as the unshifted rows' mask (each row's last real slot dropped).

Every problem with a batch (a missing key, labels None, a float tensor, a 4-D mask, rows
longer than the limit, ids past the vocabulary) is a :class:`DataError` naming the collator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from hpc_mca.data.batch import PackedBatch
from hpc_mca.data.errors import DataError
from hpc_mca.data.tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    from .data import ExampleDataset

__all__ = ["ALIGNED", "PRESHIFTED", "CollatedRows", "batch_from_collated", "label_convention"]

ALIGNED = "aligned"
PRESHIFTED = "pre-shifted"
PROBE_BATCHES = 8
"""Micro-batches the probe collates, at most, to tell the convention."""


class CollatedRows(torch.utils.data.Dataset):
    """A script's dataset and collator: the loader samples its examples as it samples rows,
    and each micro-batch comes from the collator (:meth:`collate`)."""

    packed = False

    def __init__(self, dataset: ExampleDataset, collator: Callable[[list[Any]], object], *, vocab_size: int,
                 max_length: int, pairs: bool, what: str) -> None:
        self.dataset, self.collator = dataset, collator
        self.vocab_size, self.max_length, self.pairs, self.what = vocab_size, max_length, pairs, what
        self.convention: str | None = None
        self.name = f"{what}'s data_collator ({_describe(collator)})"

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def probe(self, micro_batch_size: int) -> str:
        """Collate the first micro-batches (dataset order) until their labels tell the
        convention; check each as training will; the convention (module docstring)."""
        size = micro_batch_size  # examples: rows, or pairs of rows
        for start in range(0, min(len(self), PROBE_BATCHES * size), size):
            examples = [self.dataset[i] for i in range(start, min(start + size, len(self)))]
            self._read(examples, f"examples {start}..{start + len(examples) - 1}")
            if self.convention is not None:
                return self.convention
        raise DataError(f"{self.name}: the labels of its first batches fit both conventions (every "
                        "trained label equals its input token and the next one), so the trainer "
                        "cannot tell whether they are shifted; valid: batches whose labels show it "
                        "(transformers' aligned labels, or ROLL's pre-shifted ones)")

    def collate(self, examples: Sequence[Any]) -> PackedBatch:
        return self._read(list(examples), f"{len(examples)} examples")

    def _read(self, examples: list[Any], which: str) -> PackedBatch:
        where = f"{self.name}, {which}"
        try:
            collated = self.collator(examples)
        except DataError:
            raise
        except Exception as err:  # noqa: BLE001 - the script's code: its error, named, one line
            raise DataError(f"{where}: the collator raised {type(err).__name__}: "
                            f"{' '.join(str(err).split())[:300]}") from None
        ids, labels, mask, positions = _tensors(collated, where)
        convention = label_convention(ids, labels, mask)
        if convention is None or (self.convention is not None and convention not in (self.convention, "both")):
            expected = f" (its earlier batches were {self.convention})" if self.convention else ""
            raise DataError(f"{where}: labels match neither input_ids (transformers' aligned labels) "
                            f"nor input_ids one token on (ROLL's pre-shifted labels){expected}; "
                            "valid: each trained label equal to its input token, or to the next "
                            "one, in every batch")
        if self.convention is None and convention != "both":
            self.convention = convention
        batch = batch_from_collated(ids, labels, mask, positions, convention=self.convention or ALIGNED,
                                    pairs=self.pairs, where=where)
        if batch.seq_length > self.max_length:
            raise DataError(f"{where}: rows of {batch.seq_length} tokens; valid: at most "
                            f"{self.max_length} (the run's sequence length)")
        low, high = int(batch.input_ids.min()), int(batch.input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise DataError(f"{where}: token id {high if high >= self.vocab_size else low}; valid: "
                            f"ids in [0, {self.vocab_size}) (the model's vocabulary)")
        return batch


def _describe(collator: object) -> str:
    wrapped = getattr(collator, "__wrapped__", None)  # functools.wraps, as ROLL's wrapper
    own = getattr(collator, "__qualname__", None) or type(collator).__name__
    return f"{own} around {type(wrapped).__name__}" if wrapped is not None else own


def _tensors(batch: object, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                torch.Tensor | None]:
    """input_ids, labels, attention_mask and position_ids of a collated batch, each checked."""
    if not isinstance(batch, Mapping):
        raise DataError(f"{where}: the collator returned a {type(batch).__name__}; valid: a dict "
                        "of [batch, seq] tensors")
    for key in ("input_ids", "labels"):
        if batch.get(key) is None:
            said = "labels=None" if key in batch else f"no {key!r}"
            raise DataError(f"{where}: the collator returned {said} (it returned "
                            f"{sorted(batch)}); valid: a dict with input_ids and labels [batch, seq] "
                            "(attention_mask, position_ids optional)")
    ids, labels = (_integers(batch[key], key, where) for key in ("input_ids", "labels"))
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise DataError(f"{where}: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)}; "
                        "valid: both [batch, seq]")
    mask = batch.get("attention_mask")
    positions = batch.get("position_ids")
    mask = None if mask is None else _integers(mask, "attention_mask", where)
    positions = None if positions is None else _integers(positions, "position_ids", where)
    if mask is not None and mask.dim() != 2:
        raise DataError(f"{where}: attention_mask {tuple(mask.shape)}; valid: [batch, seq] with 1 on "
                        "real tokens (a 4-D mask, block_diag_attn, is built by the trainer itself)")
    if positions is not None and positions.shape != ids.shape:
        raise DataError(f"{where}: position_ids {tuple(positions.shape)}; valid: [batch, seq] as "
                        "input_ids (multimodal rope positions are not read)")
    return ids, labels, mask, positions


def _integers(value: object, key: str, where: str) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError) as err:
        raise DataError(f"{where}: {key} is not a tensor ({' '.join(str(err).split())[:120]}); "
                        "valid: integers [batch, seq]") from None
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        if key != "attention_mask" or tensor.dtype != torch.bool:
            raise DataError(f"{where}: {key} has dtype {tensor.dtype}; valid: an integer dtype "
                            "(torch.long)")
    return tensor.long()


def label_convention(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Which convention the trained labels of a batch follow: ALIGNED, PRESHIFTED, "both" (they
    cannot tell) or None (neither)."""
    trained = labels != IGNORE_INDEX
    if not bool(trained.any()):
        return "both"
    aligned = bool((labels[trained] == ids[trained]).all())
    wide = mask is not None and mask.shape[1] == ids.shape[1] + 1  # only ROLL's wrapper makes one
    real = (torch.ones_like(ids, dtype=torch.bool) if mask is None
            else _real_slots(mask, ids, PRESHIFTED, "") > 0 if wide else mask > 0)
    checkable = trained[:, :-1] & real[:, 1:]  # a label whose next slot holds a real token
    # (the last trained label of a pre-shifted row targets the token the wrapper dropped: it
    # cannot be checked, and it cannot contradict)
    shifted = bool((labels[:, :-1][checkable] == ids[:, 1:][checkable]).all())
    if aligned and shifted:
        return "both"
    return ALIGNED if aligned else PRESHIFTED if shifted else None


def batch_from_collated(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None,
                        positions: torch.Tensor | None, *, convention: str, pairs: bool = False,
                        where: str = "data_collator") -> PackedBatch:
    """The trainer's micro-batch of a collator's checked ``[B, S]`` tensors (module
    docstring): targets in Megatron's convention, pairs as neighbouring rows."""
    documents = _real_slots(mask, ids, convention, where)
    if positions is None:
        positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    if bool((positions[:, 1:] < positions[:, :-1]).any()):
        raise DataError(f"{where}: position_ids restart inside a row (several documents packed in "
                        "one); valid: padded rows of one example each, or data_collator=None with "
                        "sequence_packing: true for packed rows")
    targets = labels.clone()
    if convention == ALIGNED:
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]
    if pairs:
        order = _pair_order(ids.shape[0], where)
        ids, targets, positions, documents = (t[order] for t in (ids, targets, positions, documents))
    return PackedBatch(ids, targets, (targets != IGNORE_INDEX).float(), positions, documents)


def _real_slots(mask: torch.Tensor | None, ids: torch.Tensor, convention: str, where: str) -> torch.Tensor:
    """1 on the real input tokens of each row, 0 on padding."""
    if mask is None:
        return torch.ones_like(ids)
    real = mask.clamp(min=0, max=1)
    width = ids.shape[1]
    if real.shape[1] == width + 1 and convention == PRESHIFTED:
        # the unshifted rows' mask: each row's last real slot is the input the wrapper dropped
        last = (real.cumsum(1) == real.sum(1, keepdim=True)) & (real > 0)
        real = (real * ~last)[:, :width]
    if real.shape[1] != width:
        raise DataError(f"{where}: attention_mask has {mask.shape[1]} slots a row, input_ids "
                        f"{width}; valid: the same width")
    return real


def _pair_order(rows: int, where: str) -> torch.Tensor:
    """Rows ``[c_1..c_B, r_1..r_B]`` as ``[c_1, r_1, c_2, r_2, ...]`` (how the pair losses read
    a micro-batch's documents)."""
    if rows % 2:
        raise DataError(f"{where}: {rows} rows in a pair batch; valid: the chosen rows, then as many "
                        "rejected rows (LLaMA-Factory's PairwiseDataCollatorWithPadding)")
    half = rows // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
