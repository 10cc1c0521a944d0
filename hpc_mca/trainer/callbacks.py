"""The loop's flow through transformers' callback protocol.

``Trainer`` drives a ``transformers.trainer_callback.CallbackHandler``, so users' and
transformers' own ``TrainerCallback``s see the usual events (on_train_begin, on_step_begin,
on_pre_optimizer_step, on_optimizer_step, on_step_end, on_log, on_evaluate, on_save,
on_train_end) and can steer the run through ``TrainerControl`` (should_log, should_evaluate,
should_save, should_training_stop) exactly as with ``transformers.Trainer``.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState


class StepFlowCallback(DefaultFlowCallback):
    """Sets the control flags from ``logging_steps``, ``eval_steps`` and ``save_steps``.

    transformers' DefaultFlowCallback reads its strategies from HF TrainingArguments fields
    this project does not have (logging_strategy, eval_delay, ...); step intervals are the
    whole story here, and the last step always logs, evaluates (when there is eval data) and
    saves (when saving is on).
    """

    def __init__(self, has_eval: bool) -> None:
        self.has_eval = has_eval

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        step, last = state.global_step, state.global_step >= state.max_steps
        control.should_log |= _every(step, args.logging_steps) or last
        control.should_evaluate |= self.has_eval and (_every(step, args.eval_steps) or last)
        control.should_save |= bool(args.save_steps) and (_every(step, args.save_steps) or last)
        control.should_training_stop |= last
        return control

    def on_epoch_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        return control


def _every(step: int, interval: int | None) -> bool:
    return bool(interval) and step % interval == 0
