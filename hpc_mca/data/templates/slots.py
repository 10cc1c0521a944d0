"""Slots: the pieces a template turns one message into, and how they become token ids.

A slot is either text (with ``{{content}}`` where the message goes), a named special token
(:class:`SpecialToken`, looked up in the vocabulary, never tokenized as text) or the
tokenizer's current bos/eos (:data:`BOS`, :data:`EOS`, resolved at encoding time because
:func:`~hpc_mca.data.templates.get_template` may replace the eos). Every slot is tokenized on
its own, as LLaMA-Factory does: no merge ever crosses a slot boundary, which is what makes
per-turn token ids stable.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from hpc_mca.data.errors import DataError

from .tools import ToolFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class SpecialToken:
    """A vocabulary entry inserted by id (e.g. glm's ``[gMASK]``)."""

    token: str


@dataclass(frozen=True)
class TokenizerToken:
    """The tokenizer's bos or eos, whatever it is when the slot is encoded (absent: nothing)."""

    which: str
    """``"bos"`` or ``"eos"``."""


BOS = TokenizerToken("bos")
EOS = TokenizerToken("eos")

Slot = str | SpecialToken | TokenizerToken


@dataclass(frozen=True)
class Format:
    """The slots of one message kind; ``fill`` puts the message into them."""

    slots: tuple[Slot, ...] = ("{{content}}",)

    def fill(self, **values: str) -> list[Slot]:
        """The slots with each ``{{name}}`` replaced by ``values[name]``.

        Only the first occurrence per slot is replaced, and the values are applied one after
        the other in the order given, so a value that itself contains a later ``{{name}}``
        gets that one filled too: LLaMA-Factory does both, and its token ids are the reference.
        """
        filled: list[Slot] = []
        for slot in self.slots:
            if isinstance(slot, str):
                for name, value in values.items():
                    slot = slot.replace("{{" + name + "}}", value, 1)
            filled.append(slot)
        return filled


def _decode_calls(text: str) -> list[tuple[str, str]]:
    """``(name, arguments as JSON)`` of a tool-call message: one JSON object or a list of them."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"a function_call message is not valid JSON ({err}): {text[:80]!r}") from None
    calls = calls if isinstance(calls, list) else [calls]
    try:
        return [(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in calls]
    except (KeyError, TypeError):
        raise DataError(f"a function_call message needs objects with 'name' and 'arguments': {text[:80]!r}") from None


def _between(words: tuple[str, str] | None, text: str) -> re.Match[str] | None:
    if not words:
        return None
    return re.search(f"{re.escape(words[0])}(.*?){re.escape(words[1])}", text, re.DOTALL)


@dataclass(frozen=True)
class FunctionFormat(Format):
    """The assistant's tool calls: the JSON calls are rewritten in the template's tool syntax.

    With ``tool_call_words`` given and found, only the calls between them are rewritten and
    the text outside them (e.g. a reasoning block) is kept in front; otherwise a reasoning
    block delimited by ``thought_words`` is kept in front and the rest is the JSON. Without
    either pair (LLaMA-Factory's system-folding templates pass none) the whole text is JSON.
    """

    def fill_calls(self, content: str, syntax: ToolFormat, thought_words: tuple[str, str] | None = None,
                   tool_call_words: tuple[str, str] | None = None) -> list[Slot]:
        wrapped = _between(tool_call_words, content)
        if wrapped is not None:
            text = content.replace(wrapped.group(0), "") + syntax.calls(_decode_calls(wrapped.group(1)))
            return self.fill(content=text)
        thought = _between(thought_words, content)
        if thought is None:
            return self.fill(content=syntax.calls(_decode_calls(content)))
        calls = syntax.calls(_decode_calls(content.replace(thought.group(0), "")))
        return self.fill(content=thought.group(0) + calls)


def slots_to_ids(tokenizer: PreTrainedTokenizerBase, slots: list[Slot]) -> list[int]:
    """Token ids of ``slots``, each text slot tokenized on its own (empty ones skipped)."""
    ids: list[int] = []
    for slot in slots:
        if isinstance(slot, str):
            if slot:
                ids += tokenizer.encode(slot, add_special_tokens=False)
        elif isinstance(slot, SpecialToken):
            ids.append(cast(int, tokenizer.convert_tokens_to_ids(slot.token)))  # one token: one id
        else:
            token_id = tokenizer.bos_token_id if slot.which == "bos" else tokenizer.eos_token_id
            if token_id is not None:
                ids.append(token_id)
    return ids
