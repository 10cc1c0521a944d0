"""The chat_template (jinja) LLaMA-Factory writes into a tokenizer for a slot template.

It matters for the tokenizer saved with a checkpoint: a model trained with ``template: alpaca``
should chat with alpaca's format afterwards, exactly as a LLaMA-Factory export does. The string
is LLaMA-Factory's byte for byte (it is part of the tokenizer's fingerprint and saved files).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .slots import Slot, SpecialToken

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .template import SlotTemplate


class _NotExpressible(Exception):
    """A slot (a special token by name) that has no jinja spelling; the chat_template is kept."""


def _quoted(text: str) -> str:
    return "'" + text.replace("'", r"\'") + "'"


def _expression(slots: tuple[Slot, ...] | list[Slot], tokenizer: PreTrainedTokenizerBase,
                placeholder: str = "content") -> str:
    """A jinja expression concatenating the slots, ``{{content}}`` read from ``placeholder``."""
    parts = []
    for slot in slots:
        if isinstance(slot, SpecialToken):
            raise _NotExpressible(slot.token)
        if isinstance(slot, str):
            before, found, after = slot.partition("{{content}}")
            parts += [_quoted(before)] if before else []
            parts += [placeholder] if found else []
            parts += [_quoted(after)] if found and after else []
        else:
            # The token's text, not {{ eos_token }}: the tokenizer's eos may be replaced later.
            token_id = tokenizer.bos_token_id if slot.which == "bos" else tokenizer.eos_token_id
            token = tokenizer.bos_token if slot.which == "bos" else tokenizer.eos_token
            parts += [_quoted_raw(token)] if token_id is not None else []
    return " + ".join(parts)


def _quoted_raw(token: str) -> str:
    # LLaMA-Factory quotes bos/eos without escaping; kept so that the strings stay equal.
    return "'" + token + "'"


_SYSTEM_FROM_MESSAGES = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% endif %}"
)


def slot_template_jinja(template: SlotTemplate, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The chat_template for ``template``, or None when a slot cannot be written in jinja."""
    try:
        prefix = _expression(template.prefix.slots, tokenizer)
        system = _expression(template.system.slots, tokenizer, placeholder="system_message")
        user = _expression(template.user.slots, tokenizer)
        assistant = _expression(template.assistant.slots, tokenizer)
    except _NotExpressible:
        return None
    text = "{{ " + prefix + " }}" if prefix else ""
    if template.default_system:
        text += "{% set system_message = " + _quoted(template.default_system) + " %}"
    text += _SYSTEM_FROM_MESSAGES
    if template.fold_system:
        text += ("{% for message in loop_messages %}"
                 "{% if loop.index0 == 0 and system_message is defined %}"
                 "{% set content = " + system + " + message['content'] %}"
                 "{% else %}{% set content = message['content'] %}{% endif %}")
    else:
        text += ("{% if system_message is defined %}{{ " + system + " }}{% endif %}"
                 "{% for message in loop_messages %}{% set content = message['content'] %}")
    text += ("{% if message['role'] == 'user' %}{{ " + user + " }}"
             "{% elif message['role'] == 'assistant' %}{{ " + assistant + " }}"
             "{% endif %}{% endfor %}")
    return text
