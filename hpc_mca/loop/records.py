"""The records a training step hands to the step end (metrics, callbacks, the boundary), the
same for both backends."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepResult:
    loss: float
    """Mean loss per real token of the global batch."""
    tokens: int
    """Real (loss-bearing) tokens in the global batch."""
    input_tokens: int
    """Non-padding input tokens in the global batch (what throughput counts)."""
    grad_norm: float
    skipped: bool
    """True when the gradients were not finite and the update was skipped."""
    moe_aux_loss: float | None = None
    mtp_losses: list[float] = dataclasses.field(default_factory=list)
    """Mean loss per token of each MTP depth (1, 2, ...) over the global batch."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The objective's extra metrics (dpo: rewards/..., logps/...)."""
    seconds: float = 0.0
    """Wall time from the previous step's end to this one's: callbacks, data, forward-backward,
    optimizer, to the end of its device work (CUDA is synchronised first), and the previous
    step's bookkeeping; evaluation, checkpoint saves and logging are not counted. Over a
    logging window these add up to the window the logged tokens/s divides by."""
