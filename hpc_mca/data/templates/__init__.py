"""Chat templates: conversations to per-turn token ids, as LLaMA-Factory 0.9.5 tokenizes them.

``get_template(name, tokenizer)`` is the entry point. The named templates (:mod:`.registry`)
reproduce LLaMA-Factory's token ids exactly (checked against LLaMA-Factory itself in
tests/test_templates.py); ``chat`` (the tokenizer's own jinja) and ``plain`` are this project's
(:mod:`.chat` says how ``chat`` differs from LLaMA-Factory's parse of the jinja).

Messages are ``{"role": ..., "content": ...}`` with LLaMA-Factory's roles: ``user``,
``assistant``, ``function`` (a tool call written by the assistant, JSON) and ``observation``
(the tool's result); the system message and the tools (a JSON list) are passed separately.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpc_mca.data.errors import DataError

from .chat import ChatTemplate, PlainTemplate, tokenizer_template
from .registry import REGISTRY
from .slots import EOS, FunctionFormat
from .template import Message, SlotTemplate, Template, Turn, VisionTokens
from .tools import TOOL_FORMATS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEMPLATE_NAMES: tuple[str, ...] = ("chat", "plain", *sorted(REGISTRY))
"""Every ``data.template`` value."""
TOOL_FORMAT_NAMES: tuple[str, ...] = tuple(sorted(TOOL_FORMATS))
"""Every ``data.tool_format`` value."""

__all__ = [
    "TEMPLATE_NAMES",
    "TOOL_FORMAT_NAMES",
    "ChatTemplate",
    "Message",
    "PlainTemplate",
    "SlotTemplate",
    "Template",
    "Turn",
    "VisionTokens",
    "get_template",
    "template_vision",
]


def template_vision(template: Template) -> VisionTokens | None:
    """How ``template`` writes images (a vision-language template), or None (text only: the
    tokenizer's own ``chat`` and ``plain`` are text only too)."""
    return getattr(template, "vision", None)


def get_template(name: str, tokenizer: PreTrainedTokenizerBase, *, enable_thinking: bool | None = True,
                 default_system: str | None = None, tool_format: str | None = None,
                 preserve_thinking: bool = False) -> Template:
    """A fresh template ``name``, configured, with ``tokenizer`` fixed in place for it.

    As LLaMA-Factory's ``get_template_and_fix_tokenizer``: ``tool_format`` swaps the tools'
    description and the tool-call syntax (and resets the tool-call slots to the bare answer +
    eos); ``default_system`` replaces the template's; ``enable_thinking`` / ``preserve_thinking``
    only act on reasoning templates. The tokenizer's eos may be replaced or added, its pad set,
    stop words added as special tokens and its chat_template replaced, so fingerprint it after.
    """
    if name not in TEMPLATE_NAMES:
        raise DataError(f"data.template={name!r} is not a template; valid: {', '.join(TEMPLATE_NAMES)}")
    if tool_format is not None and tool_format not in TOOL_FORMATS:
        raise DataError(f"data.tool_format={tool_format!r} is not a tool format; valid: "
                        f"{', '.join(TOOL_FORMAT_NAMES)}")
    if name in ("chat", "plain"):
        return tokenizer_template(name, tokenizer, default_system, tool_format)
    template = REGISTRY[name]
    changes: dict[str, Any] = {}
    if tool_format is not None:
        changes["tool_format"] = tool_format
        changes["function"] = FunctionFormat(("{{content}}",) if template.efficient_eos else ("{{content}}", EOS))
    if default_system is not None:
        changes["default_system"] = default_system
    if template.reasoning:
        changes.update(enable_thinking=enable_thinking, preserve_thinking=preserve_thinking)
    template = replace(template, **changes)
    template.fix_tokenizer(tokenizer)
    return template
