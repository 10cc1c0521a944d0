"""Scoring against a frozen reference model on the Megatron backend: a part an objective holds
(dpo's and kto's do, :mod:`.dpo`, :mod:`.kto`), not a base class to inherit from.

A stage whose loss compares the policy's per-document log-probabilities with a reference's
(``reference_model`` in its registry row) composes :class:`ReferenceScoring`, which owns:

* **the reference**: a second copy of the model chunks in the same layout, copied from the
  policy before any checkpoint is loaded (so it is the starting model, HF weights or the
  seeded random init alike), frozen, kept in eval mode and outside DDP and the optimizer. With
  LoRA it is the policy itself with its adapters switched off (the frozen base is the starting
  model), so there is no second copy. With ``finetuning.ref_model`` it is that directory's
  model, built and loaded in the same layout (LoRA or not). A reference-free run (orpo, simpo,
  ``use_ref_model: false``) has none: no chunks, no reference pass (:func:`reference_chunks`
  builds all of these).
* **its forward-only pass**: before each step (and each eval batch) Megatron's schedule runs
  the reference over the same micro-batches (pipeline exchanges included), and its
  per-document log-probabilities wait, keyed by micro-batch, for the policy's loss function
  (:meth:`ReferenceScoring.reference_logps`).
* **per-document log-probabilities** come from the model's own per-token loss (Megatron's
  vocab-parallel cross entropy, so TP never gathers the vocabulary), summed per document on the
  last pipeline stage (:func:`hpc_mca.loop.preference.document_logps`; under CP the shares are
  summed over the CP group, with an identity backward).
* **the loss contract**: Megatron's per-token one, arranged so that the gradient is that of the
  mean over the global batch's examples (``rows_per_example`` documents each: a pair, kto's
  answer and KL row). A micro-batch's loss function returns its summed example losses times
  ``T/E`` (answer tokens over examples of the whole global batch, counted before the step) and
  its own answer-token count (:meth:`ReferenceScoring.loss_output`); ``finalize_model_grads``
  divides by the global token count ``T``. Counting tokens rather than examples keeps
  Megatron's per-token normalisation of the MoE auxiliary losses, which it scales by each
  micro-batch's tokens. The logged loss is the plain mean over examples
  (:meth:`ReferenceScoring.mean_loss`). Examples are counted on CP rank 0 only (its CP peers
  hold the same examples); tokens on every CP rank (each holds its share).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_mca.config.sections import FinetuningArguments, TrainConfig
from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.preference import document_logps, uses_reference
from hpc_mca.models.converters import ModelConverter, converter_for
from hpc_mca.runtime.distributed import RankContext
from hpc_mca.stages import get_stage

from .objective import ChunkBuilder, ForwardStep, LossOutput, Schedule
from .step import forward_with_loss, model_inputs

__all__ = ["ReferenceScoring", "reference_chunks"]

DocumentLoss = Callable[[PackedBatch, torch.Tensor], LossOutput]
"""(micro-batch, the policy's per-token loss) -> the micro-batch's :data:`LossOutput`."""


class ReferenceScoring:
    """The frozen reference of a run, its pass before each global batch, and the per-example
    loss contract (see the module docstring)."""

    def __init__(self, config: TrainConfig, ctx: RankContext) -> None:
        self.config, self.ctx = config, ctx
        self.chunks: list[torch.nn.Module] = []
        """The reference's chunks: none for a reference-free run; the policy's own with LoRA."""
        self.tokens_per_example = 1.0
        """Answer tokens over examples of the global batch being run (the loss contract)."""
        self._rows = get_stage(config.finetuning.stage).rows_per_example
        self._logps: dict[int, torch.Tensor] = {}
        # What trains decides what the reference is (LoRA: the policy's own frozen base).
        self._converter = converter_for(config.finetuning)
        self._is_policy = False

    def attach(self, chunks: list[torch.nn.Module], build: ChunkBuilder) -> None:
        """The reference (:func:`reference_chunks`), or none for a reference-free run; the
        parameters this rank then holds are logged (rank 0)."""
        self.chunks = reference_chunks(chunks, build, self.config.finetuning, self._converter)
        self._is_policy = self.chunks is chunks
        if self.ctx.is_main:
            policy = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            held = 0 if self._is_policy else sum(
                p.numel() for chunk in self.chunks for p in chunk.parameters())
            what = _describe(self.config.finetuning, self._is_policy)
            print(f"{self.config.finetuning.stage} reference: {what}; "
                  f"parameters held on rank 0: policy {policy}, reference {held}", flush=True)

    def before_forward(self, micro_batches: list[PackedBatch], schedule: Schedule) -> None:
        """The reference's per-document log-probabilities of these micro-batches, and the
        global batch's answer tokens per example."""
        from megatron.core import parallel_state as mpu

        counts = torch.tensor([sum(float(b.loss_mask.sum()) for b in micro_batches),
                               sum(b.num_documents // self._rows for b in micro_batches)
                               * float(mpu.get_context_parallel_rank() == 0)],
                              dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(counts, group=mpu.get_data_parallel_group(with_context_parallel=True))
        self.tokens_per_example = float(counts[0] / counts[1]) if counts[1] else 1.0
        self._logps = {}
        if not self.chunks:  # reference-free: no reference forward at all
            return
        with torch.no_grad(), self._reference_mode():
            outputs = schedule(self.chunks, self._reference_step, micro_batches)
        if outputs:  # the last pipeline stage, where the policy's loss needs them
            for batch, out in zip(micro_batches, outputs):
                self._logps[id(batch)] = out["reference"]

    def reference_logps(self, batch: PackedBatch, device: torch.device) -> torch.Tensor | None:
        """The reference's per-document log-probabilities of ``batch`` (taken: each is read
        once, by the batch's loss function); None for a reference-free run."""
        return self._logps.pop(id(batch)).to(device) if self.chunks else None

    def forward_step(self, loss: DocumentLoss) -> ForwardStep:
        """The policy's forward step: the model's per-token loss, handed to ``loss`` with its
        micro-batch on the last pipeline stage."""
        def forward_step(data_iterator: Iterator[PackedBatch], model: torch.nn.Module
                         ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
            batch = next(data_iterator)
            output = _forward(model, batch, self.ctx.device)
            return output, partial(loss, batch)

        return forward_step

    def loss_output(self, losses: torch.Tensor, batch: PackedBatch, key: str, report: torch.Tensor
                    ) -> LossOutput:
        """The loss contract: ``losses`` (one per example of ``batch``) summed times the global
        batch's answer tokens per example, this rank's answer tokens, and ``report`` under
        ``key``. Every CP rank backpropagates the whole loss into its own tokens (see
        :func:`hpc_mca.loop.preference.sum_over_group`)."""
        tokens = batch.loss_mask.sum().to(torch.int)  # this rank's share of the answer tokens
        return losses.sum() * self.tokens_per_example, tokens, {key: report}

    def sums(self, outputs: list[dict[str, torch.Tensor]], key: str, width: int, input_tokens: int
             ) -> torch.Tensor:
        """[loss, count, *``width`` metric sums, input tokens] of the reports under ``key``,
        summed over micro-batches, DP×CP and PP, on every rank."""
        from megatron.core import parallel_state as mpu

        sums = torch.zeros(3 + width, dtype=torch.float64, device=self.ctx.device)
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            if outputs:
                sums[:-1] = torch.stack([out[key] for out in outputs]).sum(dim=0).to(sums)
            sums[-1] = input_tokens
            dist.all_reduce(sums, group=mpu.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(sums, group=mpu.get_pipeline_model_parallel_group())
        return sums

    def mean_loss(self, outputs: list[dict[str, torch.Tensor]], key: str, width: int, input_tokens: int
                  ) -> tuple[float, int, int]:
        """(mean loss per example, examples, input tokens) of a global batch, on every rank."""
        sums = self.sums(outputs, key, width, input_tokens)
        loss_sum, examples, inputs = float(sums[0]), int(sums[1]), int(sums[-1])
        return (loss_sum / examples if examples else float("nan")), examples, inputs

    @contextlib.contextmanager
    def _reference_mode(self) -> Iterator[None]:
        """LoRA: the shared chunks as the reference, adapters off and in eval mode (dropout
        off), back to what they were afterwards. A separate reference is always so."""
        if not self._is_policy:
            yield
            return
        modes = [chunk.training for chunk in self.chunks]
        for chunk in self.chunks:
            chunk.eval()
        try:
            with self._converter.adapters_off(self.chunks):
                yield
        finally:
            for chunk, mode in zip(self.chunks, modes):
                chunk.train(mode)

    def _reference_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module
                        ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
        batch = next(data_iterator)
        return _forward(model, batch, self.ctx.device), partial(self._reference_out, batch)

    def _reference_out(self, batch: PackedBatch, per_token: torch.Tensor) -> LossOutput:
        from megatron.core import parallel_state as mpu

        logps, _ = document_logps(batch, per_token, mpu.get_context_parallel_group())
        zero = per_token.sum() * 0.0
        return zero, torch.tensor(0, dtype=torch.int), {"reference": logps.detach()}


def _forward(model: torch.nn.Module, batch: PackedBatch, device: torch.device) -> torch.Tensor:
    """The model's per-token loss of ``batch`` (Megatron's GPTModel with labels)."""
    return forward_with_loss(model, model_inputs(batch, device))


def reference_chunks(chunks: list[torch.nn.Module], build: ChunkBuilder, ft: FinetuningArguments,
                     converter: ModelConverter) -> list[torch.nn.Module]:
    """The frozen reference model's chunks, in the policy's layout (TP/PP/EP): none for a
    reference-free run (:func:`~hpc_mca.loop.preference.uses_reference`); ``ft.ref_model``'s
    directory, built and loaded as the policy is from ``model_name_or_path`` (``build`` takes
    the directory and whether to load weights; a config-only directory gets the seeded init,
    as a config-only policy does); else with LoRA the policy's own chunks (its frozen base,
    adapters switched off while it runs); else a copy of the policy's starting weights (called
    before any checkpoint is loaded). Frozen and in eval mode, outside DDP and the optimizer.
    The one place a reference is made: ``ft.ref_model_adapters`` are merged onto ``ref_model``
    here (LLaMA-Factory reads them only with it)."""
    if not uses_reference(ft):
        return []
    if ft.ref_model is not None:
        from hpc_mca.models.adapter_import import merge_adapters

        source = Path(ft.ref_model)
        reference = build(source, load_weights=any(source.glob("*.safetensors")))
        # ref_model_adapters merged onto it in order (the seed only draws A factors that the
        # adapters' own replace).
        merge_adapters(reference, ft, ft.ref_model_adapters or [], model_path=str(source), seed=0)
    elif converter.reference_is_base:
        return chunks
    else:
        reference = build()
        for ref, policy in zip(reference, chunks):
            ref.load_state_dict(policy.state_dict())
    for ref in reference:
        ref.eval()
        ref.requires_grad_(False)
    return reference


def _describe(ft: FinetuningArguments, is_policy: bool) -> str:
    if not uses_reference(ft):
        why = (f"pref_loss {ft.pref_loss!r} is reference-free" if ft.use_ref_model is not False
               else "use_ref_model is false")
        return f"none ({why})"
    if ft.ref_model is not None:
        return f"ref_model {ft.ref_model}"
    return "the policy with its adapters off" if is_policy else "a frozen copy of the starting model"
