"""The stage registry: every training stage (``finetuning.stage``) and the traits the rest of
hpc-mca reads from it, in one table.

Data, the planner (memory and cost), the config rules, both backends and the CLI ask a
:class:`Stage` what to do (how rows are read, how many rows an example takes, whether a frozen
reference model runs) instead of comparing stage names, so a name appears in exactly one
place: :data:`STAGES` below (``tests/test_stages.py`` fails on a comparison against a stage
name anywhere else).

Adding a stage is one module plus one row:

1. the module: the stage's objective for the Megatron backend (a subclass of
   :class:`hpc_mca.trainer.objective.Objective`, e.g. ``hpc_mca/trainer/kto.py``) and, if the
   standard backend's loss differs too, a subclass of
   :class:`hpc_mca.standard.trainer.StandardTrainer` (``hpc_mca/standard/dpo.py`` is dpo's);
2. the row: a :class:`Stage` in :data:`STAGES` naming them by dotted path, with its traits
   (and the name out of :data:`RESERVED_STAGES` if it was reserved).

A stage that reads rows in a way none reads yet (as kto's unpaired feedback did: FEEDBACK)
also adds its kind here, its tokenizer to ``hpc_mca.data.dataset._READERS`` and its dataset formats to
``hpc_mca.data.records.FORMATS_BY_READS``.

The implementations are named by strings and imported only by :func:`load`, which the
backends call: this package is layer 0 (pure data: the standard library, no torch, nothing of
hpc_mca), so data and the planner can read it without importing a trainer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["CONVERSATION", "CONVERSATION_DATA_KEYS", "FEEDBACK", "PREFERENCE_PAIR", "REFERENCE_FREE_LOSSES",
           "RESERVED_STAGES", "STAGES", "STAGE_NAMES", "TEXT", "TEXT_DATA_KEYS", "Stage", "get_stage", "load",
           "reference_runs", "stage_context", "stages_where"]

# How a stage's data rows are read and tokenized (hpc_mca.data routes on these, not on names).
TEXT = "text"
"""Plain text (or a Megatron indexed corpus), every token trained."""
CONVERSATION = "conversation"
"""A supervised conversation (alpaca or sharegpt), the answers trained."""
PREFERENCE_PAIR = "preference_pair"
"""A prompt with a chosen and a rejected answer (a dataset_info entry with ranking: true)."""
FEEDBACK = "feedback"
"""A prompt, one answer and a boolean ``kto_tag`` (true = desirable): LLaMA-Factory's unpaired
feedback (a dataset_info entry with ``columns.kto_tag``). Each example is two rows, the answer
and a mismatched answer to the same prompt (kto's KL row)."""


@dataclass(frozen=True)
class Stage:
    """One training stage: what it reads, what it costs, and where its code lives."""

    name: str
    """The ``finetuning.stage`` value (and ``--stage``)."""
    reads: str
    """How a data row is read and tokenized: TEXT, CONVERSATION, PREFERENCE_PAIR or FEEDBACK."""
    rows_per_example: int
    """Rows one example takes, kept together through mixing, held-out splits and batching
    (2 for a preference pair: chosen then rejected; 2 for feedback: the answer then its KL
    row); the planner's micro-batch counts them."""
    reference_model: bool
    """A frozen reference policy scores every batch. Its weights cost memory unless LoRA (the
    base with the adapters off is the reference then)."""
    extra_forwards: int
    """Forward passes a micro-batch costs beyond the policy's own (the planner's cost model:
    the reference model's forward, with or without LoRA)."""
    data_keys: tuple[str, ...]
    """The ``data.*`` settings that act for this stage (beside the ones every stage reads):
    outside it they are refused (config scope); inside they key the tokenization cache."""
    exact_match: bool
    """Evaluation adds the exact-match metric (generated answer == reference answer)."""
    megatron: str
    """The Megatron backend's objective, ``"module:Class"``."""
    standard: str
    """The standard (transformers) backend's trainer class, ``"module:Class"``."""


TEXT_DATA_KEYS = ("text_field", "pt_chunking")
"""The data settings of plain-text stages: the records' text field, how documents are cut."""
CONVERSATION_DATA_KEYS = ("template", "train_on_prompt")
"""The data settings of conversation stages: the chat template, whether prompts train."""
_STANDARD = "hpc_mca.standard.trainer:StandardTrainer"

STAGES: tuple[Stage, ...] = (
    Stage("pt", TEXT, 1, reference_model=False, extra_forwards=0, data_keys=TEXT_DATA_KEYS,
          exact_match=False, megatron="hpc_mca.trainer.objective:Objective", standard=_STANDARD),
    Stage("sft", CONVERSATION, 1, reference_model=False, extra_forwards=0,
          data_keys=CONVERSATION_DATA_KEYS, exact_match=True,
          megatron="hpc_mca.trainer.objective:SftObjective", standard=_STANDARD),
    Stage("dpo", PREFERENCE_PAIR, 2, reference_model=True, extra_forwards=1,
          data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
          megatron="hpc_mca.trainer.dpo:DpoObjective",
          standard="hpc_mca.standard.dpo:StandardDpoTrainer"),
    # kto: the reference scores the answer and KL rows (the policy's own pass scores both).
    Stage("kto", FEEDBACK, 2, reference_model=True, extra_forwards=1,
          data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
          megatron="hpc_mca.trainer.kto:KtoObjective",
          standard="hpc_mca.standard.kto:StandardKtoTrainer"),
)
"""Every stage a run can train, in the order the valid choices are listed."""

STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)
"""The valid ``finetuning.stage`` values."""
RESERVED_STAGES: tuple[str, ...] = ()
"""Names kept for stages on their way (refused as "not yet supported" rather than "not
valid"); a stage leaves this tuple when its row joins STAGES."""

_BY_NAME = {stage.name: stage for stage in STAGES}


def get_stage(name: str) -> Stage:
    """The stage called ``name``; KeyError for any other (the config rules have refused it by
    the time anything else asks)."""
    return _BY_NAME[name]


REFERENCE_FREE_LOSSES = ("orpo", "simpo")
"""Preference losses of the policy alone (``finetuning.pref_loss``): no reference model."""


def reference_runs(stage: str, pref_loss: str = "sigmoid", use_ref_model: bool | None = None
                   ) -> bool:
    """Whether a run of ``stage`` holds and runs a frozen reference model: the stage's trait,
    unless the preference loss is reference-free (orpo, simpo) or ``use_ref_model`` is false
    (TRL's ``reference_free``). Both backends and the planner ask this one function, so a
    reference-free run neither builds a reference nor is sized with one."""
    if not get_stage(stage).reference_model:
        return False
    return pref_loss not in REFERENCE_FREE_LOSSES and use_ref_model is not False


def stages_where(trait: str, value: object) -> tuple[str, ...]:
    """Names of the stages whose ``trait`` equals ``value`` (e.g. ``"reads", TEXT``), for the
    messages that list the stages a setting fits."""
    return tuple(stage.name for stage in STAGES if getattr(stage, trait) == value)


def stage_context(names: tuple[str, ...]) -> str:
    """``names`` as a config message names the context: ``finetuning.stage='dpo'`` for one,
    ``finetuning.stage sft or dpo`` for several."""
    if len(names) == 1:
        return f"finetuning.stage={names[0]!r}"
    return f"finetuning.stage {', '.join(names[:-1])} or {names[-1]}"


def load(path: str) -> type:
    """The class a ``"module:Class"`` path names, imported now (the backends call this, so
    the registry itself imports no implementation)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
