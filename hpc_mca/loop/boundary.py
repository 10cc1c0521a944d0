"""The step boundary: the one place that decides whether a step ends with a save, a stop, or both.

Inputs, all read at the end of every optimizer step:

* ``save_steps`` (every N steps) and the last step (``max_steps`` of the run's counters,
  :class:`~hpc_mca.loop.counters.RunCounters`; always saved: the finished marker names a
  checkpoint of the final step);
* a stop request agreed by all ranks (:class:`hpc_mca.checkpoint.requeue.StopSignal`: a
  USR1/TERM to the batch shell or to a rank), which saves and stops early, leaving the run
  for the batch script to requeue (the requeue contract is in that module);
* what a ``TrainerCallback`` asked through ``TrainerControl`` (transformers' protocol):
  ``should_save`` saves; ``should_training_stop`` ends the run here (early stopping: saved and
  marked finished, as with ``transformers.Trainer``).

The trainer acts on the :class:`Decision`; the checkpointer only saves when told.
"""

from __future__ import annotations

import dataclasses
import time

from transformers.trainer_callback import TrainerControl

from hpc_mca.checkpoint.requeue import StopSignal

from .counters import RunCounters


@dataclasses.dataclass(frozen=True)
class Decision:
    save: bool
    stop: bool
    reason: str = ""
    """Why it saves: interval, end, signal or callback (recorded in checkpoint.json)."""
    stop_time: float | None = None
    """For a stop on a signal: when it was requested (the batch shell's clock when it wrote the
    record), for the signal-to-durable line of the save."""

    @property
    def requeue(self) -> bool:
        """Stopped early on a signal: not finished, the batch script decides what comes next."""
        return self.reason == "signal"


class StepBoundary:
    """Decides save/stop at each step end; :meth:`decide` is a collective (every rank, every
    step), so all ranks take the same decision at the same step."""

    def __init__(self, save_steps: int | None, signal: StopSignal, is_main: bool) -> None:
        self.save_steps = save_steps or 0  # None: no interval saves
        self.signal, self.is_main = signal, is_main

    def decide(self, counters: RunCounters, control: TrainerControl) -> Decision:
        """The decision at the end of the step ``counters`` name (the run's last at
        ``counters.max_steps``)."""
        code = self.signal.agree()
        step = counters.global_step
        if counters.at_end or control.should_training_stop:
            # The run ends here; a signal that arrives with its last step changes nothing.
            return Decision(save=True, stop=True, reason="end")
        if code:
            if self.is_main:
                # Whether the job comes back (requeue) or ends (cancel) is the batch shell's
                # decision, printed in its end banner.
                print(f"stop requested by {StopSignal.describe(code)} at step {step}: saving and "
                      "exiting", flush=True)
            return Decision(save=True, stop=True, reason="signal",
                            stop_time=self.signal.received_at or time.time())
        if self.save_steps and step % self.save_steps == 0:
            return Decision(save=True, stop=False, reason="interval")
        if control.should_save:
            return Decision(save=True, stop=False, reason="callback")
        return Decision(save=False, stop=False)
