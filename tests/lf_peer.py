"""LLaMA-Factory 0.9.5 as the behavioural peer of the data tests.

``bin/setup-env`` installs ``llamafactory==0.9.5`` with ``--no-deps``: its own requirement pins
(transformers, datasets, gradio, ...) would fight ours, and the data modules the tests compare
against need nothing beyond what our venv already has, except one package stubbed below.
Without LLaMA-Factory, importing this module fails (the parity tests never pass by skipping).

Stubs (each only in the test process, installed before LLaMA-Factory is first imported):

- ``torchaudio``: ``llamafactory/data/mm_plugin.py`` imports it at module load, but only its audio
  plugins call it (``torchaudio.load`` / ``resample`` on audio inputs), and the templates we
  compare all use the text-only "base" plugin. The real package is a compiled extension pinned
  to one torch build, too heavy to install for an import. The stub carries a module spec
  because transformers probes optional packages with ``importlib.util.find_spec``, which fails
  on a module without one; transformers' own probe is evaluated (and cached as "absent") before
  the stub is installed, so transformers never takes the stub for the real thing.

Usage::

    from lf_peer import lf_template, lf_get_template_and_fix_tokenizer, lf_parse_template
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from copy import deepcopy
from typing import Any


def _stub_torchaudio() -> None:
    if "torchaudio" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchaudio_available()  # cache the true answer before the stub exists
    stub = types.ModuleType("torchaudio")
    stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    stub.__doc__ = "Empty stand-in: LLaMA-Factory's audio plugins are never used by these tests."
    sys.modules["torchaudio"] = stub


def _load_data_arguments() -> type:
    """LLaMA-Factory's DataArguments, loaded from its file alone.

    ``llamafactory.hparams/__init__`` also imports the model/training argument modules, which
    need ``omegaconf`` (not in our venv) and do nothing for data tests; ``data_args.py`` itself
    imports only the standard library, so it is loaded on its own instead.
    """
    name = "llamafactory.hparams.data_args"
    if name not in sys.modules:
        import llamafactory

        path = f"{llamafactory.__path__[0]}/hparams/data_args.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].DataArguments


if importlib.util.find_spec("llamafactory") is None:  # an error, not a skip: the parity tests are the contract
    raise ImportError("LLaMA-Factory 0.9.5, the peer of the data tests, is not installed; run bin/setup-env")
_stub_torchaudio()

from llamafactory.data import converter as lf_converter
from llamafactory.data import template as lf_template_module
from llamafactory.data.processor import pairwise as lf_pairwise
from llamafactory.data.processor import supervised as lf_supervised

DataArguments = _load_data_arguments()
LF_TEMPLATES: dict[str, Any] = lf_template_module.TEMPLATES
"""LLaMA-Factory's registry; never mutate its entries (use the copies handed out below)."""

__all__ = [
    "LF_TEMPLATES",
    "DataArguments",
    "lf_converter",
    "lf_data_args",
    "lf_get_template_and_fix_tokenizer",
    "lf_pairwise",
    "lf_parse_template",
    "lf_supervised",
    "lf_template",
]


def lf_template(name: str) -> Any:
    """A private copy of LLaMA-Factory's registered template ``name`` (unconfigured, tokenizer untouched)."""
    return deepcopy(LF_TEMPLATES[name])


def lf_data_args(**data_args: Any) -> Any:
    """LLaMA-Factory's DataArguments with the given fields (``template=None`` means "parse the tokenizer's")."""
    return DataArguments(**data_args)


def lf_get_template_and_fix_tokenizer(tokenizer: Any, **data_args: Any) -> Any:
    """LLaMA-Factory's ``get_template_and_fix_tokenizer`` on a copy of the registry entry.

    LLaMA-Factory configures the registered object itself (tool format, default system,
    thinking flags), so calling it twice in one process would leak settings between tests;
    the copy keeps every call independent. ``tokenizer`` is fixed in place, as in LLaMA-Factory.
    """
    args = lf_data_args(**data_args)
    name = args.template or "empty"  # without a name and a chat_template LLaMA-Factory configures "empty"
    original = LF_TEMPLATES[name]
    LF_TEMPLATES[name] = deepcopy(original)
    try:
        return lf_template_module.get_template_and_fix_tokenizer(tokenizer, args)
    finally:
        LF_TEMPLATES[name] = original


def lf_parse_template(tokenizer: Any) -> Any:
    """The template LLaMA-Factory derives from ``tokenizer.chat_template`` when none is named."""
    return lf_template_module.parse_template(tokenizer)


def lf_lora_targets(model: Any, freeze_vision_tower: bool = True) -> list[str]:
    """LLaMA-Factory's LoRA targets for ``lora_target: all`` on a transformers model
    (``find_all_linear_modules``, then ``patch_target_modules`` for a vision-language model),
    with its default freeze settings. Its ``model_utils`` modules are loaded from their files
    alone: their package's ``__init__`` imports the model loader, which needs a newer trl."""
    import llamafactory

    modules = {}
    for name in ("visual", "misc"):  # misc imports visual
        dotted = f"llamafactory.model.model_utils.{name}"
        if dotted not in sys.modules:
            spec = importlib.util.spec_from_file_location(
                dotted, f"{llamafactory.__path__[0]}/model/model_utils/{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[dotted] = module
            spec.loader.exec_module(module)
        modules[name] = sys.modules[dotted]
    settings = types.SimpleNamespace(freeze_vision_tower=freeze_vision_tower,
                                     freeze_multi_modal_projector=True, freeze_language_model=False)
    names = modules["misc"].find_all_linear_modules(model, freeze_vision_tower)
    return modules["visual"].patch_target_modules(model, settings, names)
