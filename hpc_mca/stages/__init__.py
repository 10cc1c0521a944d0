"""The stage registry: every training stage (``finetuning.stage``) and the traits the rest of
hpc-mca reads from it, in one table.

Data, the planner (memory and cost), the config rules, both backends and the CLI ask a
:class:`Stage` what to do (how rows are read, how many rows an example takes, whether a frozen
reference model runs, which loss settings act, whether rows pack) instead of comparing stage
names, so a name appears in exactly one place: its row (``tests/test_stages.py`` fails on a
comparison against a stage name anywhere else).

Adding a stage is one module plus one row, and no edit anywhere else:

1. the module: the stage's objective for the Megatron backend (a subclass of
   :class:`hpc_mca.trainer.objective.Objective` only, composing the parts it shares with other
   stages rather than inheriting them from another stage: dpo's and kto's both hold a
   :class:`hpc_mca.trainer.reference.ReferenceScoring`) and, if the standard backend's loss
   differs too, a subclass of :class:`hpc_mca.standard.trainer.StandardTrainer` (composing
   :class:`hpc_mca.standard.reference.ReferenceScoring` where a reference scores the rows);
2. the row: a :class:`Stage` naming them by dotted path, with its traits, passed to
   :func:`register` — here for a stage of hpc-mca's (the ``register`` calls below), or in the
   module itself for a stage outside the package: a plugin module named by the environment
   variable :data:`PLUGINS_ENV` (comma-separated module names importable from the processes'
   ``sys.path``, or ``.py`` file paths) is imported the first time anything reads the
   registry, in every process (``hpc-mca plan``/``submit`` on the login node and each rank:
   Slurm passes the environment on), so its ``register`` call reaches them all.
   ``tests/test_stage_plugin.py`` trains such a stage on both backends.

A stage that reads rows in a way none reads yet (as kto's unpaired feedback did: FEEDBACK)
also adds its kind to :data:`KINDS`, its tokenizer to ``hpc_mca.data.dataset._READERS``, its
dataset formats to ``hpc_mca.data.records.FORMATS_BY_READS`` and, where they apply, its
dataset_info marker column (``hpc_mca.data.sources.MARKER_COLUMNS``) and the layout of a
script's examples (``hpc_mca.api.data.EXAMPLE_KEYS``). A new ``finetuning.*`` setting of its
loss is a config field (``hpc_mca.config.sections``) with its check
(``hpc_mca.config.finetuning_rules``), named in :data:`LOSS_SETTINGS` (the config scope then
refuses it for the stages whose row does not list it).

The implementations are named by strings and imported only by :func:`load`, which the
backends call: this package is layer 0 (pure data: the standard library, no torch, nothing of
hpc_mca), so data and the planner can read it without importing a trainer.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

__all__ = ["CONVERSATION", "CONVERSATION_DATA_KEYS", "DATA_KEY_GROUPS", "FEEDBACK", "KINDS", "KTO_SETTINGS",
           "LOSS_SETTINGS", "PLUGINS_ENV", "PREFERENCE_PAIR", "PREFERENCE_SETTINGS", "REFERENCE_FREE_LOSSES",
           "RESERVED_STAGES", "STAGES", "STAGE_NAMES", "TEXT", "TEXT_DATA_KEYS", "Stage", "get_stage", "load",
           "reference_runs", "register", "stage_context", "stages_where", "stages_with", "unregister"]

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
KINDS = (TEXT, CONVERSATION, PREFERENCE_PAIR, FEEDBACK)
"""Every way of reading rows (a row's ``reads``)."""


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
    """The standard (transformers) backend's trainer class, ``"module:Class"``. With
    ``reference_model`` it is built with ``reference=``: the frozen reference model, or None
    where there is no separate one (``hpc_mca.standard.reference.frozen_reference``)."""
    loss_settings: tuple[str, ...] = ()
    """The ``finetuning.*`` settings the stage's loss reads (dpo's ``pref_*``, kto's weights):
    checked for it (config rules), refused for the stages whose row lacks them (config
    scope)."""
    mtp_loss: bool = True
    """The objective adds the MTP layers' loss; false refuses ``model.mtp_num_layers > 0``."""
    answers_only: bool = False
    """The loss scores answer tokens only: ``data.train_on_prompt`` is refused."""
    packing: bool = True
    """Rows may be packed (``data.sequence_packing``), a packed row holding whole examples
    (``rows_per_example`` × ``cutoff_len`` tokens fit); false refuses packing (kto's loss
    builds its KL rows per micro-batch from unpacked rows)."""
    micro_step_examples: int = 1
    """The fewest examples a micro-step (per-device batch × data-parallel ranks) may hold: 2
    where the loss relates each example to another of its micro-step (kto's KL row is another
    example's answer)."""


TEXT_DATA_KEYS = ("text_field", "pt_chunking")
"""The data settings of plain-text stages: the records' text field, how documents are cut."""
CONVERSATION_DATA_KEYS = ("train_on_prompt",)
"""The data settings of conversation stages: whether prompts train. (``data.template`` is
every stage's: it fixes the tokenizer's eos and pad, and ends pt documents, as in LLaMA-Factory.)"""
DATA_KEY_GROUPS = (TEXT_DATA_KEYS, CONVERSATION_DATA_KEYS)
"""The ``data_keys`` a row may name (the config scope refuses each group outside its stages)."""
PREFERENCE_SETTINGS = ("pref_beta", "pref_loss", "pref_ftx", "dpo_label_smoothing", "simpo_gamma",
                       "use_ref_model", "ref_model")
"""dpo's loss settings: the preference loss, its β and options, and its reference."""
KTO_SETTINGS = ("pref_beta", "kto_chosen_weight", "kto_rejected_weight")
"""kto's loss settings: β and the desirable and undesirable examples' weights."""
LOSS_SETTINGS = tuple(dict.fromkeys((*PREFERENCE_SETTINGS, *KTO_SETTINGS)))
"""Every ``finetuning.*`` setting a row's ``loss_settings`` may name: each is checked where a
stage reads it (``hpc_mca.config.finetuning_rules``) and refused elsewhere
(``hpc_mca.config.scope``)."""
PLUGINS_ENV = "HPC_MCA_STAGE_MODULES"
"""Environment variable naming modules that :func:`register` stages of their own when
imported, comma-separated: module names (importable from ``sys.path``) or paths of ``.py``
files (imported as the module of the file's stem name); the registry imports them the first
time it is read."""

_T = TypeVar("_T")
_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_REGISTRY: dict[str, Stage] = {}


def _rows() -> dict[str, Stage]:
    """The registry, after importing the :data:`PLUGINS_ENV` modules not imported yet (the
    variable is read each time: a process forked before it was set still sees its modules)."""
    for entry in os.environ.get(PLUGINS_ENV, "").replace(",", " ").split():
        try:
            _import(entry)
        except (ImportError, OSError) as err:
            raise ImportError(f"{PLUGINS_ENV}: stage module {entry!r} does not import: {err}") from err
    return _REGISTRY


def _import(entry: str) -> None:
    """Import a module by name, or a ``.py`` file by path as the module of its stem's name,
    unless imported already. A module being imported is in ``sys.modules`` already, so one
    that reads the registry while it registers is not imported twice."""
    if not entry.endswith(".py"):
        if entry not in sys.modules:
            importlib.import_module(entry)
        return
    path = os.path.abspath(entry)
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        if getattr(sys.modules[name], "__file__", None) != path:
            raise ImportError(f"another module named {name!r} is imported already")
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # first, as the import system does: its dotted paths name it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


class _Live(Sequence[_T]):
    """A read-only tuple-like view of the registry as it is when read (:func:`register` adds
    to what every module that imported the view sees)."""

    def __init__(self, read: Callable[[], tuple[_T, ...]]) -> None:
        self._read = read

    @overload
    def __getitem__(self, index: int) -> _T: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[_T, ...]: ...
    def __getitem__(self, index: int | slice) -> _T | tuple[_T, ...]:
        return self._read()[index]

    def __len__(self) -> int:
        return len(self._read())

    def __iter__(self) -> Iterator[_T]:
        return iter(self._read())

    def __contains__(self, value: object) -> bool:
        return value in self._read()

    def __repr__(self) -> str:
        return repr(self._read())


RESERVED_STAGES: tuple[str, ...] = ()
"""Names kept for stages on their way (refused as "not yet supported" rather than "not
valid"); a stage leaves this tuple when its row is registered."""


def register(stage: Stage) -> Stage:
    """Add ``stage``'s row (returned), checked: a name no stage has (nor reserved), a known
    ``reads`` kind, sane counts, a known ``data_keys`` group and ``"module:Class"`` paths
    (imported only when a backend loads them). ValueError otherwise, naming the field."""
    problems = []
    if not re.fullmatch(r"[a-z][a-z0-9_]*", stage.name):
        problems.append(f"name {stage.name!r} is not a lower-case identifier")
    elif stage.name in _REGISTRY or stage.name in RESERVED_STAGES:
        problems.append(f"name {stage.name!r} is taken")
    if stage.reads not in KINDS:
        problems.append(f"reads {stage.reads!r} is not one of {', '.join(KINDS)}")
    if stage.rows_per_example < 1 or stage.extra_forwards < 0 or stage.micro_step_examples < 1:
        problems.append("rows_per_example and micro_step_examples must be >= 1, extra_forwards >= 0")
    if stage.data_keys not in DATA_KEY_GROUPS:
        problems.append(f"data_keys {stage.data_keys!r} is not one of {DATA_KEY_GROUPS!r}")
    for field, path in (("megatron", stage.megatron), ("standard", stage.standard)):
        if not _PATH.fullmatch(path):
            problems.append(f"{field} {path!r} is not a dotted 'module:Class' path")
    unknown = [name for name in stage.loss_settings if name not in LOSS_SETTINGS]
    if unknown:
        problems.append(f"loss_settings {unknown!r} are not among {', '.join(LOSS_SETTINGS)}")
    if problems:
        raise ValueError(f"stage row {stage.name!r}: " + "; ".join(problems))
    _REGISTRY[stage.name] = stage
    return stage


def unregister(name: str) -> None:
    """Remove the row ``name`` (a test's throwaway stage); KeyError if there is none."""
    del _REGISTRY[name]


_STANDARD = "hpc_mca.standard.trainer:StandardTrainer"

register(Stage("pt", TEXT, 1, reference_model=False, extra_forwards=0, data_keys=TEXT_DATA_KEYS,
               exact_match=False, megatron="hpc_mca.trainer.objective:Objective", standard=_STANDARD))
register(Stage("sft", CONVERSATION, 1, reference_model=False, extra_forwards=0,
               data_keys=CONVERSATION_DATA_KEYS, exact_match=True,
               megatron="hpc_mca.trainer.objective:SftObjective", standard=_STANDARD))
register(Stage("dpo", PREFERENCE_PAIR, 2, reference_model=True, extra_forwards=1,
               data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
               megatron="hpc_mca.trainer.dpo:DpoObjective",
               standard="hpc_mca.standard.dpo:StandardDpoTrainer",
               loss_settings=PREFERENCE_SETTINGS, mtp_loss=False, answers_only=True))
# kto: the reference scores the answer and KL rows (the policy's own pass scores both).
register(Stage("kto", FEEDBACK, 2, reference_model=True, extra_forwards=1,
               data_keys=CONVERSATION_DATA_KEYS, exact_match=False,
               megatron="hpc_mca.trainer.kto:KtoObjective",
               standard="hpc_mca.standard.kto:StandardKtoTrainer",
               loss_settings=KTO_SETTINGS, mtp_loss=False, answers_only=True, packing=False,
               micro_step_examples=2))

STAGES: Sequence[Stage] = _Live(lambda: tuple(_rows().values()))
"""Every stage a run can train, in the order the valid choices are listed (hpc-mca's, then
the registered ones)."""
STAGE_NAMES: Sequence[str] = _Live(lambda: tuple(_rows()))
"""The valid ``finetuning.stage`` values."""


def get_stage(name: str) -> Stage:
    """The stage called ``name``; KeyError for any other (the config rules have refused it by
    the time anything else asks)."""
    return _rows()[name]


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
    return stages_with(lambda stage: getattr(stage, trait) == value)


def stages_with(test: Callable[[Stage], bool]) -> tuple[str, ...]:
    """Names of the stages ``test`` holds for (e.g. the ones whose loss reads a setting)."""
    return tuple(stage.name for stage in _rows().values() if test(stage))


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
