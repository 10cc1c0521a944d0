"""Training objectives: what a stage (pt, sft, dpo, kto; and the MTP loss) brings to the loop.

The loop (:class:`hpc_mca.trainer.trainer.Trainer`) knows Megatron's schedules, DDP, the
optimizer and checkpoints; it does not know what a batch means. An :class:`Objective` owns
that:

* ``build_data``: the train/eval rows of its stage (a preference pair for dpo, say);
* ``forward_step``: the ``forward_step_func`` Megatron's schedule calls per micro-batch, and
  the loss function it returns;
* ``reduce_loss``: the step's loss from the schedule's outputs, reduced over micro-batches,
  data- and context-parallel ranks and the pipeline;
* ``eval_metric``: an extra evaluation metric, if the stage has one;
* ``auxiliary_models``: models the objective needs beside the trained one (dpo's frozen
  reference), built by the objective in ``attach``, neither wrapped in DDP nor checkpointed;
* ``before_forward``: work before the schedule runs a global batch (dpo's reference pass);
* ``step_metrics``: the stage's extra metrics of a step (dpo's rewards), on every rank.

A stage's objective subclasses :class:`Objective` (or :class:`SftObjective`, whose data and
metric it keeps) and composes what it shares with other stages: dpo's and kto's each hold a
:class:`~hpc_mca.trainer.reference.ReferenceScoring` (the frozen reference, its forward-only
pass, per-document log-probabilities, the per-example loss contract); neither inherits the
other. The stage's registry row names its objective (:data:`hpc_mca.trainer.stages.OBJECTIVES`
reads it).
pt and sft both train next-token prediction with Megatron's per-token loss contract (see
:mod:`hpc_mca.trainer.step`); they differ in the data (sft masks the prompt's labels) and in
sft's exact-match metric.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from hpc_mca.config.sections import TrainConfig
from hpc_mca.data.batch import PackedBatch
from hpc_mca.runtime.distributed import RankContext

from .step import make_forward_step, reduce_step_loss

if TYPE_CHECKING:
    from hpc_mca.data.dataset import TrainingData

EvalMetric = Callable[[list[torch.nn.Module], Any], dict[str, float]]
"""(DDP-wrapped model chunks, eval RowDataset) -> extra eval metrics, computed on every rank."""
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]
"""A micro-batch's loss function's result, Megatron's per-token contract: (loss to
backpropagate, its token count as int, reports summed over micro-batches by key)."""
ForwardStep = Callable[[Iterator[PackedBatch], torch.nn.Module],
                       tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]]
"""Megatron's ``forward_step_func``: (micro-batch iterator, model chunk) -> (its output, the
loss function of the last pipeline stage's output)."""
Schedule = Callable[[list[torch.nn.Module], ForwardStep, list[PackedBatch]], list[dict[str, torch.Tensor]]]
"""(model chunks, forward step, micro-batches) -> the forward-only schedule's outputs (the loss
functions' reports, on the last pipeline stage; empty elsewhere)."""


class ChunkBuilder(Protocol):
    """Builds another copy of the model chunks in the trained ones' layout: of ``source`` (a
    model directory; default the run's model), loading its weights or not."""

    def __call__(self, source: Path | None = None, load_weights: bool | None = None
                 ) -> list[torch.nn.Module]: ...


class Objective:
    """Next-token prediction: the loss is the mean over every real token of the global batch."""

    name = "pt"
    unit = "tokens"
    """What the loss is a mean over (steps.jsonl records the count under this name)."""

    def __init__(self, config: TrainConfig, ctx: RankContext, vocab_size: int) -> None:
        self.config, self.ctx, self.vocab_size = config, ctx, vocab_size

    def build_data(self) -> TrainingData:
        """This stage's :class:`~hpc_mca.data.dataset.TrainingData` (token ids beyond the
        model's vocabulary are bad input)."""
        from hpc_mca.data.dataset import build_datasets

        return build_datasets(self.config.data, self.config.data_run(), vocab_size=self.vocab_size)

    def forward_step(self) -> ForwardStep:
        return make_forward_step(self.ctx.device)

    def reduce_loss(self, outputs: list[dict[str, torch.Tensor]], input_tokens: int = 0
                    ) -> tuple[float, int, int]:
        """(mean loss per real token, real tokens, input tokens) of a global batch, the same
        on every rank (a collective over the DP×CP and PP groups)."""
        from megatron.core import parallel_state as mpu

        return reduce_step_loss(outputs, mpu.get_data_parallel_group(with_context_parallel=True),
                                mpu.get_pipeline_model_parallel_group(),
                                mpu.is_pipeline_last_stage(ignore_virtual=True), self.ctx.device,
                                input_tokens)

    def mtp_loss_sums(self) -> torch.Tensor:
        """[depths, 2]: summed token loss and token count of each MTP depth over the
        micro-batches run since the last call (the global batch), the same on every rank;
        [0, 2] without MTP. A collective over the DP×CP and PP groups, called after every
        forward-backward."""
        from megatron.core import parallel_state as mpu

        from hpc_mca.models.mtp import MTP_LOSSES

        depths = self.config.model.mtp_num_layers
        sums = MTP_LOSSES.take(depths, self.ctx.device)
        if not depths:
            return sums
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            dist.all_reduce(sums, group=mpu.get_data_parallel_group(with_context_parallel=True))
        else:
            sums.zero_()
        dist.all_reduce(sums, group=mpu.get_pipeline_model_parallel_group())
        return sums

    def eval_metric(self) -> EvalMetric | None:
        return None

    def attach(self, chunks: list[torch.nn.Module], build: ChunkBuilder) -> None:
        """Called once with the model chunks to train (before DDP and before any checkpoint
        is loaded) and a builder of another copy of them."""

    def auxiliary_models(self) -> list[torch.nn.Module]:
        return []

    def before_forward(self, micro_batches: list[PackedBatch], schedule: Schedule) -> None:
        """Called on every rank before the schedule runs ``micro_batches`` (training or eval);
        ``schedule(chunks, forward_step, micro_batches)`` runs a forward-only pass."""

    def step_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Extra metrics of a step from the schedule's outputs, the same on every rank."""
        return {}


class SftObjective(Objective):
    """Next-token prediction on the responses (the data masks the prompts), plus exact-match
    accuracy of greedy answers on the eval rows."""

    name = "sft"

    def eval_metric(self) -> EvalMetric | None:
        from hpc_mca.trainer.evaluation import exact_match_accuracy

        config, vocab, device = self.config, self.vocab_size, self.ctx.device
        # The data view is taken when the metric runs: the metric exists before resolve() (a
        # stage's traits are read from it), its data settings only after.
        return lambda model, rows: exact_match_accuracy(model, rows, config.data_run(), vocab, device)
