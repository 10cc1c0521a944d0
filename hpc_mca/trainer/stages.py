"""Stage name -> training objective: the one table ``finetuning.stage`` is routed by.

A table of its own (not in :mod:`.objective`) because the stages' modules build on
:class:`~hpc_mca.trainer.objective.Objective`: keeping the table apart keeps imports one-way.
"""

from __future__ import annotations

from hpc_mca.config.sections import TrainConfig
from hpc_mca.runtime.distributed import RankContext

from .dpo import DpoObjective
from .objective import Objective, SftObjective

OBJECTIVES: dict[str, type[Objective]] = {"pt": Objective, "sft": SftObjective,
                                          "dpo": DpoObjective}
"""Stage name -> objective. A new stage adds its class here and its name to
:data:`hpc_mca.config.sections.STAGES`."""


def objective_for(config: TrainConfig, ctx: RankContext, vocab_size: int) -> Objective:
    return OBJECTIVES[config.finetuning.stage](config, ctx, vocab_size)
