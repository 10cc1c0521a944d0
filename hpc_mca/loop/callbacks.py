"""The loop's flow through transformers' callback protocol.

``Trainer`` drives a ``transformers.trainer_callback.CallbackHandler``, so users' and
transformers' own ``TrainerCallback``s see the usual events (on_train_begin, on_step_begin,
on_pre_optimizer_step, on_optimizer_step, on_step_end, on_log, on_evaluate, on_save,
on_train_end) and can steer the run through ``TrainerControl`` (should_log, should_evaluate,
should_save, should_training_stop) exactly as with ``transformers.Trainer``; the step
boundary (:mod:`.boundary`) turns the last two into a save or the end of the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

if TYPE_CHECKING:
    from transformers import TrainingArguments as HFArguments

    from hpc_mca.config.sections import TrainingArguments


class StepFlowCallback(DefaultFlowCallback):
    """Sets the logging and evaluation flags every ``logging_steps`` and ``eval_steps``.

    transformers' DefaultFlowCallback reads its strategies from HF TrainingArguments fields
    this project does not have (logging_strategy, eval_delay, ...), and the standard backend
    turns them off; step intervals are the whole story here, and the last step always logs and
    evaluates (when there is eval data). The intervals are given, not read from ``args``: the
    standard backend's callbacks get transformers' arguments, whose eval interval it leaves
    unset. Saving and stopping are decided in one place, :mod:`hpc_mca.loop.boundary`, which
    also honours ``should_save``/``should_training_stop`` set by other callbacks.
    """

    def __init__(self, has_eval: bool, logging_steps: int, eval_steps: int | None) -> None:
        self.has_eval, self.logging_steps, self.eval_steps = has_eval, logging_steps, eval_steps

    def on_step_end(self, args: HFArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> TrainerControl:
        step, last = state.global_step, state.global_step >= state.max_steps
        control.should_log |= _every(step, self.logging_steps) or last
        control.should_evaluate |= self.has_eval and (_every(step, self.eval_steps) or last)
        return control

    def on_epoch_end(self, args: HFArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object) -> TrainerControl:
        return control


def callback_args(training: TrainingArguments) -> HFArguments:
    """What the Megatron backend's callbacks get as transformers' ``args``: the run's training
    section, which carries transformers' TrainingArguments names (what callbacks read), not
    the class; the handler's events are typed for the class."""
    return cast("HFArguments", training)


def _every(step: int, interval: int | None) -> bool:
    return bool(interval) and step % (interval or 1) == 0
