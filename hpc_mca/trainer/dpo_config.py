"""``DPOConfig``: the preference loss of ``DPOTrainer(train_config=DPOConfig(...))``, under
mcore_adapter's names; each field is the run config's ``finetuning`` field named beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc_mca.stages import REFERENCE_FREE_LOSSES

__all__ = ["DPOConfig"]


@dataclass
class DPOConfig:
    """The dpo stage's loss settings (see :class:`hpc_mca.config.sections.FinetuningArguments`)."""

    beta: float = field(default=0.1, metadata={"help": "β (finetuning.pref_beta)."})
    pref_loss: str = field(default="sigmoid", metadata={
        "help": "sigmoid, ipo, hinge, orpo or simpo (finetuning.pref_loss)."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "cDPO's label smoothing, with sigmoid (finetuning.dpo_label_smoothing)."})
    ftx: float = field(default=0.0, metadata={
        "help": "Weight of the chosen answer's NLL (finetuning.pref_ftx)."})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "simpo's target margin (finetuning.simpo_gamma)."})

    @property
    def use_ref_model(self) -> bool:
        """Whether the loss scores the pairs against a reference model (orpo and simpo are
        reference-free)."""
        return self.pref_loss not in REFERENCE_FREE_LOSSES

    def finetuning_fields(self) -> dict[str, Any]:
        """The run config's ``finetuning`` fields these set."""
        return {"stage": "dpo", "pref_beta": self.beta, "pref_loss": self.pref_loss,
                "dpo_label_smoothing": self.label_smoothing, "pref_ftx": self.ftx,
                "simpo_gamma": self.simpo_gamma}
