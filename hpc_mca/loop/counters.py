"""Where a run stands: its counters in one object, which both backends' loops advance and a
checkpoint saves and restores as one unit.

:class:`RunCounters` is a ``torch.distributed.checkpoint.stateful.Stateful``: its
``state_dict()`` is what a checkpoint keeps of the run's progress, under the key ``trainer``
of a Megatron checkpoint (and as checkpoint.json's ``step``, ``consumed_samples`` and
``skipped_iters`` on both backends). Two of its fields are not saved: ``max_steps``, the
run's length, is the config's (a resumed run may be extended to another), and ``requeue`` is
how this process's part of the run ended.

Who does what: the backend calls :meth:`RunCounters.step_taken` once its optimizer step is
done (before the step-end callbacks, which read the step), the run loop
(:class:`~hpc_mca.loop.driver.RunLoop`) reads the counters and records a stop for a requeue,
the step boundary (:class:`~hpc_mca.loop.boundary.StepBoundary`) decides at the step they
name, and the checkpoint takes and puts back :meth:`state_dict` whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

__all__ = ["RunCounters"]


@dataclasses.dataclass
class RunCounters:
    """The run's counters (see the module docstring)."""

    max_steps: int
    """Optimizer steps of the whole run (``hpc_mca.config.run_length.total_training_steps``);
    the one place the loop reads it from. Not saved."""
    global_step: int = 0
    """Optimizer steps taken (a skipped one counts: it took its batch)."""
    consumed_samples: int = 0
    """Samples of the training order used so far: the data sampler's position (the next
    global batch starts here, on any data-parallel size)."""
    skipped_iters: int = 0
    """Steps whose gradients were not finite on some rank (no update)."""
    requeue: bool = False
    """This process stopped early on a signal: not finished, the batch script decides what
    comes next. Not saved (a resumed process starts without one)."""

    SAVED: ClassVar[tuple[str, ...]] = ("global_step", "consumed_samples", "skipped_iters")
    """The fields :meth:`state_dict` holds, the keys a checkpoint stores."""

    @property
    def at_end(self) -> bool:
        """The run has taken its last step."""
        return self.global_step >= self.max_steps

    def step_taken(self, samples: int, *, skipped: bool) -> None:
        """One optimizer step over ``samples`` samples is done (``skipped``: without an
        update)."""
        self.global_step += 1
        self.consumed_samples += samples
        self.skipped_iters += int(skipped)

    def state_dict(self) -> dict[str, int]:
        """The saved counters, by name (:attr:`SAVED`)."""
        return {"global_step": self.global_step, "consumed_samples": self.consumed_samples,
                "skipped_iters": self.skipped_iters}

    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Put saved counters back, all of them at once (a checkpoint without one of them is
        not this run's: KeyError names it)."""
        missing = [key for key in self.SAVED if key not in state_dict]
        if missing:
            raise KeyError(f"the saved run counters lack {', '.join(missing)}")
        self.global_step = state_dict["global_step"]
        self.consumed_samples = state_dict["consumed_samples"]
        self.skipped_iters = state_dict["skipped_iters"]
