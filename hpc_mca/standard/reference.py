"""Scoring against a frozen reference model on the standard backend: a part a trainer holds
(dpo's and kto's do, :mod:`.dpo`, :mod:`.kto`), not a base class to inherit from; the Megatron
backend's counterpart is :mod:`hpc_mca.trainer.reference`.

* **the reference** is a frozen copy of the starting model (the directory's weights, or the
  seeded init), taken before a checkpoint is loaded, in eval mode, outside DDP and the
  optimizer. With LoRA it is the policy itself with its adapters switched off (peft's
  ``disable_adapter``), in eval mode: no second copy. With ``finetuning.ref_model`` it is that
  directory's model (LoRA or not); a reference-free run has none and runs no reference
  forward (:func:`frozen_reference`, called by the backend for a stage whose row has
  ``reference_model``; the trainer gets it as ``reference=``). It runs on each micro-batch just
  before the policy does (:meth:`ReferenceScoring.reference_logps`).
* **log-probabilities** are minus the per-token cross entropy of the HF model's logits, summed
  per document with the stream's ``documents`` index (:meth:`ReferenceScoring.document_logps`).
  Under Ulysses SP each rank holds a slice of the stream; its partial sums are added over the
  SP group by :func:`~hpc_mca.loop.preference.sum_over_group` (identity backward: each rank
  backpropagates the example losses into its own tokens, the attention all-to-all carries the
  rest), the same arrangement as the Megatron backend's context parallelism.
* **the loss contract**: a micro-batch returns its summed example losses times ``W/E`` (world
  size over the global batch's examples, ``rows_per_example`` documents each, counted on SP
  rank 0 of every group before the step: :meth:`ReferenceScoring.count_items`); DDP's gradient
  average divides ``W`` back out, so the gradient is that of the mean over examples
  (:meth:`ReferenceScoring.loss`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpc_mca.loop.preference import sum_over_group, uses_reference
from hpc_mca.models.converters import converter_for, merge_hf_adapters
from hpc_mca.runtime.sequence_parallel import IGNORE_INDEX
from hpc_mca.stages import get_stage

from .data import model_inputs
from .model import load_hf_model
from .trainer import batch_count

if TYPE_CHECKING:
    from hpc_mca.config.sections import FinetuningArguments

    from .run import StandardRun

__all__ = ["ReferenceScoring", "frozen_reference"]


def frozen_reference(model: torch.nn.Module, ft: FinetuningArguments, base_is_reference: bool
                     ) -> torch.nn.Module | None:
    """The reference model of a run starting from ``model``: ``ft.ref_model``'s directory
    (loaded as the policy's is: float32, our packed attention; a config-only directory gets
    transformers' init, seeded by the caller as the policy's is), a frozen copy of ``model``
    (taken before any checkpoint is loaded), or None when there is no separate one: a
    reference-free run (:func:`~hpc_mca.loop.preference.uses_reference`), or the finetuning
    type's frozen base is the reference (LoRA: the policy with its adapters off;
    :attr:`hpc_mca.models.converters.ModelConverter.reference_is_base`). The one place a
    reference is made: ``ft.ref_model_adapters`` are merged onto ``ref_model`` here."""
    if not uses_reference(ft):
        return None
    if ft.ref_model is not None:
        reference = merge_hf_adapters(_load_hf(Path(ft.ref_model), next(model.parameters()).device),
                                      ft.ref_model_adapters or [])  # LLaMA-Factory's, in order
    elif base_is_reference:
        return None
    else:
        reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def _load_hf(path: Path, device: torch.device) -> torch.nn.Module:
    return load_hf_model(path).to(device)


class ReferenceScoring:
    """The frozen reference of a run (``reference``: from :func:`frozen_reference`), the
    per-document log-probabilities of a micro-batch under either model, and the per-example
    loss contract (see the module docstring). ``model``: the policy, whose parameters and the
    reference's rank 0 logs."""

    def __init__(self, run: StandardRun, model: torch.nn.Module, reference: torch.nn.Module | None) -> None:
        self.run, self.reference = run, reference
        ft = run.config.finetuning
        # Reference-free (orpo, simpo, use_ref_model false): no reference forward at all.
        self.with_reference = uses_reference(ft)
        # What trains decides how the policy runs as the reference (LoRA: adapters off).
        self.converter = converter_for(ft)
        self.rows = get_stage(ft.stage).rows_per_example
        if run.ctx.is_main:
            policy = sum(p.numel() for p in model.parameters())
            held = sum(p.numel() for p in reference.parameters()) if reference is not None else 0
            print(f"{ft.stage} reference: {'yes' if self.with_reference else 'none'}; parameters held "
                  f"on rank 0: policy {policy}, reference {held}", flush=True)

    def count_items(self, batch_samples: list[dict[str, torch.Tensor]]) -> float:
        """Examples of this rank's micro-batches, counted once per SP group."""
        if self.run.sp_rank != 0:
            return 0.0
        return float(sum(int(b["num_documents"]) // self.rows for b in batch_samples))

    def loss(self, losses: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
        """The micro-batch's loss to backpropagate: its ``losses`` (one per example) summed,
        times world size over the global batch's examples (``num_items_in_batch``)."""
        return losses.sum() * (self.run.world_size / batch_count(num_items_in_batch))

    def reference_logps(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]
                        ) -> torch.Tensor | None:
        """The reference's summed log-probability of each document, for the policy ``model``;
        None for a reference-free run."""
        if not self.with_reference:
            return None
        reference = self.reference if self.reference is not None else model
        with self.reference_mode(reference):
            logps, _ = self.document_logps(reference, inputs, grad=False)
        return logps

    def document_logps(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *,
                       grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed log-probability of each document's labelled tokens, their count) over the
        whole documents (SP slices summed), float32 [documents]. Without ``grad`` the model
        runs as it is: the reference's adapters are switched off by the caller
        (:meth:`reference_logps`), not here, or an eval pass of a LoRA policy would be the
        reference's."""
        with torch.no_grad() if not grad else contextlib.nullcontext():
            logits = model(**model_inputs(inputs)).logits
            labels = inputs["labels"].flatten()
            per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels,
                                        ignore_index=IGNORE_INDEX, reduction="none")
        mask = (labels != IGNORE_INDEX).float()
        index = inputs["documents"].flatten()
        docs = int(inputs["num_documents"])
        logp = per_token.new_zeros(docs).index_add(0, index, -per_token * mask)
        count = mask.new_zeros(docs).index_add(0, index, mask)
        if self.run.sp_size > 1:
            logp = sum_over_group(logp, self.run.sp_group) if grad else self._summed(logp)
            count = self._summed(count)
        return logp, count

    @contextlib.contextmanager
    def reference_mode(self, model: torch.nn.Module) -> Iterator[None]:
        """LoRA: the policy as the reference, adapters off and in eval mode (dropout off),
        back to what it was afterwards. A separate reference is always so."""
        if self.reference is not None:
            yield
            return
        peft_model = getattr(model, "module", model)  # DDP
        was_training = peft_model.training
        peft_model.eval()
        try:
            with self.converter.hf_adapters_off(peft_model):
                yield
        finally:
            peft_model.train(was_training)

    def _summed(self, x: torch.Tensor) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=self.run.sp_group)
        return total
