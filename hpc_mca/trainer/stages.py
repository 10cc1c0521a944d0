"""Stage name -> training objective of the Megatron backend, read from the stage registry.

:mod:`hpc_mca.stages` names each stage's objective by dotted path (it is layer 0 and imports
no trainer); this module imports them. A module of its own (not in :mod:`.objective`) because
the stages' modules build on :class:`~hpc_mca.trainer.objective.Objective`: keeping the table
apart keeps imports one-way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from hpc_mca.config.sections import TrainConfig
from hpc_mca.runtime.distributed import RankContext
from hpc_mca.stages import STAGE_NAMES, get_stage, load

from .objective import Objective


class _Objectives(Mapping[str, type[Objective]]):
    """Stage name -> objective class, imported from the registry's row when asked (a stage
    registered after this module was imported is there too)."""

    def __getitem__(self, name: str) -> type[Objective]:
        path = get_stage(name).megatron
        objective = load(path)
        if not issubclass(objective, Objective):
            raise TypeError(f"stage {name!r}: megatron={path!r} is not an Objective subclass")
        return objective

    def __iter__(self) -> Iterator[str]:
        return iter(STAGE_NAMES)

    def __len__(self) -> int:
        return len(STAGE_NAMES)


OBJECTIVES: Mapping[str, type[Objective]] = _Objectives()
"""Stage name -> objective. A new stage names its class in its :func:`hpc_mca.stages.register`
row."""


def objective_for(config: TrainConfig, ctx: RankContext, vocab_size: int) -> Objective:
    return OBJECTIVES[config.finetuning.stage](config, ctx, vocab_size)
