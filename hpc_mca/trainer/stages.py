"""Stage name -> training objective of the Megatron backend, read from the stage registry.

:mod:`hpc_mca.stages` names each stage's objective by dotted path (it is layer 0 and imports
no trainer); this module imports them. A module of its own (not in :mod:`.objective`) because
the stages' modules build on :class:`~hpc_mca.trainer.objective.Objective`: keeping the table
apart keeps imports one-way.
"""

from __future__ import annotations

from hpc_mca.config.sections import TrainConfig
from hpc_mca.runtime.distributed import RankContext
from hpc_mca.stages import STAGES, load

from .objective import Objective

OBJECTIVES: dict[str, type[Objective]] = {stage.name: load(stage.megatron) for stage in STAGES}
"""Stage name -> objective. A new stage names its class in its :data:`hpc_mca.stages.STAGES`
row."""


def objective_for(config: TrainConfig, ctx: RankContext, vocab_size: int) -> Objective:
    return OBJECTIVES[config.finetuning.stage](config, ctx, vocab_size)
