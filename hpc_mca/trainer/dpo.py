"""Stage dpo: direct preference optimisation against a frozen reference model.

Every micro-batch holds whole pairs, documents alternating chosen, rejected
(:mod:`hpc_mca.data.preference`). For each document the objective needs the summed
log-probability of its answer tokens, under the policy and under the reference:

* **log-probabilities** come from the model's own per-token loss (Megatron's vocab-parallel
  cross entropy, so TP never gathers the vocabulary), summed per document on the last pipeline
  stage. Under CP each rank holds a share of every document. Its partial sums are added over
  the CP group by :func:`hpc_mca.loop.preference.sum_over_group`, whose backward is the identity: each rank
  backpropagates the pair losses through its own tokens only (the CP attention's backward
  carries the rest to the other ranks).
* **the reference** is a second copy of the model chunks with the same layout. It is copied
  from the policy before any checkpoint is loaded (so it is the starting model, HF weights or
  the seeded random init alike), frozen, kept in eval mode and outside DDP and the optimizer.
  With LoRA it is the policy itself with its adapters switched off (the frozen base is the
  starting model), so there is no second copy. With ``finetuning.ref_model`` it is that
  directory's model, built and loaded in the same layout (LoRA or not). A reference-free run
  (orpo, simpo, ``use_ref_model: false``) has none: no chunks, no reference pass
  (:func:`reference_chunks` builds all of these).
  Before each step (and each eval batch) it runs its own forward-only pass of Megatron's
  schedule over the same micro-batches (pipeline exchanges included), and its per-document
  sums wait, keyed by micro-batch, for the policy's loss function.

Loss contract: Megatron's per-token one, arranged so that the gradient is that of the mean
over the global batch's pairs. A micro-batch's loss function returns its summed pair losses
times ``T/P`` (answer tokens over pairs of the whole global batch, counted before the step) and
its own answer-token count; ``finalize_model_grads`` divides by the global token count ``T``.
Counting tokens rather than pairs keeps Megatron's per-token normalisation of the MoE auxiliary
losses, which it scales by each micro-batch's tokens. The logged loss is the plain mean over
pairs. Pairs are counted on CP rank 0 only (its CP peers hold the same pairs); tokens on every
CP rank (each holds its share).

Losses (``finetuning.pref_loss``), with ``d = (π_c − ref_c) − (π_r − ref_r)`` in summed
log-probabilities: sigmoid ``−(1−ε)·logσ(βd) − ε·logσ(−βd)`` (ε = ``dpo_label_smoothing``),
hinge ``relu(1 − βd)``, ipo ``(d' − 1/(2β))²`` where d' divides each side's log-ratio by its
answer length; reference-free (see :mod:`hpc_mca.loop.preference`): orpo and simpo on per-token
mean log-probabilities, and the three above with reference log-probabilities 0 under
``use_ref_model: false``. ``pref_ftx`` adds the chosen answer's mean token NLL. The metrics are
TRL's: ``rewards/chosen`` and ``rewards/rejected`` = β·(π − ref) (orpo, simpo: β times the mean
log-probability), ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``, each a mean over the pairs; orpo adds ``nll_loss``, ``log_odds_ratio`` and
``log_odds_chosen``.
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hpc_mca.data.batch import PackedBatch
from hpc_mca.loop.preference import document_logps, metric_names, preference_loss, uses_reference
from hpc_mca.models.converters import converter_for

from .objective import ForwardStep, Objective
from .step import model_inputs

Schedule = Callable[[list[torch.nn.Module], ForwardStep, list[PackedBatch]], list[Any]]
"""(model chunks, forward step, micro-batches) -> the forward-only schedule's outputs."""


class DpoObjective(Objective):
    """Preference pairs against a frozen reference (see the module docstring)."""

    name = "dpo"
    unit = "pairs"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reference: list[torch.nn.Module] = []
        self._reference_logps: dict[int, torch.Tensor] = {}
        self._tokens_per_pair = 1.0
        # What trains decides what the reference is (LoRA: the policy's own frozen base).
        self._converter = converter_for(self.config.finetuning)
        self._metrics = metric_names(self.config.finetuning)
        self._reference_is_policy = False

    @property
    def _has_reference(self) -> bool:
        return bool(self.reference)

    def attach(self, chunks: list[torch.nn.Module], build: Callable[..., list[torch.nn.Module]]
               ) -> None:
        """The reference (:func:`reference_chunks`), or none for a reference-free run; the
        parameters this rank then holds are logged (rank 0)."""
        self.reference = reference_chunks(chunks, build, self.config.finetuning, self._converter)
        self._reference_is_policy = self.reference is chunks
        if self.ctx.is_main:
            policy = sum(p.numel() for chunk in chunks for p in chunk.parameters())
            held = 0 if self._reference_is_policy else sum(
                p.numel() for chunk in self.reference for p in chunk.parameters())
            what = _describe(self.config.finetuning, self._reference_is_policy)
            print(f"{self.config.finetuning.stage} reference: {what}; "
                  f"parameters held on rank 0: policy {policy}, reference {held}", flush=True)

    def auxiliary_models(self) -> list[torch.nn.Module]:
        return self.reference

    def before_forward(self, micro_batches: list[PackedBatch], schedule: Schedule) -> None:
        """The reference's per-document log-probabilities of these micro-batches, and the
        global batch's answer tokens per pair (see the module docstring)."""
        from megatron.core import parallel_state as mpu

        counts = torch.tensor([sum(float(b.loss_mask.sum()) for b in micro_batches),
                               sum(b.num_documents // 2 for b in micro_batches)
                               * float(mpu.get_context_parallel_rank() == 0)],
                              dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(counts, group=mpu.get_data_parallel_group(with_context_parallel=True))
        self._tokens_per_pair = float(counts[0] / counts[1]) if counts[1] else 1.0
        self._reference_logps = {}
        if not self._has_reference:  # reference-free: no reference forward at all
            return
        with torch.no_grad(), self._reference_mode():
            outputs = schedule(self.reference, self._reference_step, micro_batches)
        if outputs:  # the last pipeline stage, where the policy's loss needs them
            for batch, out in zip(micro_batches, outputs):
                self._reference_logps[id(batch)] = out["reference"]

    @contextlib.contextmanager
    def _reference_mode(self) -> Iterator[None]:
        """LoRA: the shared chunks as the reference, adapters off and in eval mode (dropout
        off), back to what they were afterwards. A separate reference is always so."""
        if not self._reference_is_policy:
            yield
            return
        modes = [chunk.training for chunk in self.reference]
        for chunk in self.reference:
            chunk.eval()
        try:
            with self._converter.adapters_off(self.reference):
                yield
        finally:
            for chunk, mode in zip(self.reference, modes):
                chunk.train(mode)

    def _reference_step(self, data_iterator: Iterator[PackedBatch], model: torch.nn.Module
                        ) -> Any:
        batch = next(data_iterator)
        output = _forward(model, model_inputs(batch, self.ctx.device))
        return output, partial(self._reference_out, batch)

    def _reference_out(self, batch: PackedBatch, per_token: torch.Tensor) -> Any:
        from megatron.core import parallel_state as mpu

        logps, _ = document_logps(batch, per_token, mpu.get_context_parallel_group())
        zero = per_token.sum() * 0.0
        return zero, torch.tensor(0, dtype=torch.int), {"reference": logps.detach()}

    def forward_step(self) -> ForwardStep:
        def forward_step(data_iterator: Iterator[PackedBatch], model: torch.nn.Module) -> Any:
            batch = next(data_iterator)
            output = _forward(model, model_inputs(batch, self.ctx.device))
            return output, partial(self._pair_loss, batch)

        return forward_step

    def _pair_loss(self, batch: PackedBatch, per_token: torch.Tensor) -> Any:
        from megatron.core import parallel_state as mpu

        logps, lengths = document_logps(batch, per_token, mpu.get_context_parallel_group())
        reference = (self._reference_logps.pop(id(batch)).to(logps.device)
                     if self._has_reference else None)
        losses, metrics = preference_loss(logps, reference, lengths, self.config.finetuning)
        counted = float(mpu.get_context_parallel_rank() == 0)  # CP peers hold the same pairs
        report = torch.cat([torch.stack([losses.detach().sum(), torch.tensor(
            float(losses.numel()), device=losses.device)]), metrics]).double() * counted
        tokens = batch.loss_mask.sum().to(torch.int)  # this rank's share of the answer tokens
        # Every CP rank backpropagates the whole loss into its own tokens (see hpc_mca.loop.preference.sum_over_group).
        return losses.sum() * self._tokens_per_pair, tokens, {"dpo": report}

    def reduce_loss(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int = 0
                    ) -> tuple[float, int, int]:
        """(mean loss per pair, pairs, input tokens) of a global batch, on every rank."""
        sums = self._sums(outputs, input_tokens)
        loss_sum, pairs, inputs = float(sums[0]), int(sums[1]), int(sums[-1])
        return (loss_sum / pairs if pairs else float("nan")), pairs, inputs

    def step_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """TRL's reward and log-probability means over the pairs of ``outputs``, on every rank."""
        sums = self._sums(outputs, 0)
        pairs = float(sums[1]) or float("nan")
        return {name: float(value) / pairs for name, value in zip(self._metrics, sums[2:-1])}

    def _report_width(self) -> int:
        """Metric sums in a micro-batch's report, after its loss and count."""
        return len(self._metrics)

    def _sums(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int) -> torch.Tensor:
        """[loss, count, *metric sums, input tokens] summed over micro-batches, DP×CP and PP."""
        from megatron.core import parallel_state as mpu

        sums = torch.zeros(3 + self._report_width(), dtype=torch.float64, device=self.ctx.device)
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            if outputs:  # each micro-batch's report, under the objective's name
                sums[:-1] = torch.stack([out[self.name] for out in outputs]).sum(dim=0).to(sums)
            sums[-1] = input_tokens
            dist.all_reduce(sums, group=mpu.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(sums, group=mpu.get_pipeline_model_parallel_group())
        return sums


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return model(inputs["input_ids"], inputs["position_ids"], None, labels=inputs["labels"],
                 loss_mask=inputs["loss_mask"], packed_seq_params=inputs["packed_seq_params"])


def reference_chunks(chunks: list[torch.nn.Module], build: Callable[..., list[torch.nn.Module]],
                     ft: Any, converter: Any) -> list[torch.nn.Module]:
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


def _describe(ft: Any, is_policy: bool) -> str:
    if not uses_reference(ft):
        why = (f"pref_loss {ft.pref_loss!r} is reference-free" if ft.use_ref_model is not False
               else "use_ref_model is false")
        return f"none ({why})"
    if ft.ref_model is not None:
        return f"ref_model {ft.ref_model}"
    return "the policy with its adapters off" if is_policy else "a frozen copy of the starting model"
