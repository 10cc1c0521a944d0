"""Records to LLaMA-Factory examples: prompt turns, response turns, system prompt and tools.

The rules are LLaMA-Factory 0.9.5's converters (``alpaca`` and ``sharegpt``), applied to the
records :mod:`.sources` maps out of a dataset_info entry (or to a file's own records for a
direct path):

* alpaca: the prompt is the ``history`` pairs followed by one user turn, ``instruction`` and
  ``input`` joined by a newline (an empty one left out); the response is ``output`` (or, for
  pairwise data, ``chosen`` then ``rejected``); no string there leaves no response, and the
  example is dropped by the sample builder.
* sharegpt: a leading system turn is the system prompt (else the ``system`` field). Turns
  alternate prompt side (user, observation) and answer side (assistant, function call),
  starting with the prompt side; a conversation ends on the answer side (pairwise: on the
  prompt side, the answers are ``chosen`` and ``rejected``). One that breaks the alternation
  or the count is *invalid*: LLaMA-Factory drops it with a warning, and so does the pipeline,
  counting it (``invalid N`` in the data line).

What is not data LLaMA-Factory could read at all (a missing field, a number where a string
belongs, an unknown role) stays a one-line DataError naming ``path:line``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import NoReturn

from .errors import DataError
from .records import Record, check_media
from .vision import resolve_images

USER, ASSISTANT, OBSERVATION, FUNCTION, SYSTEM = "user", "assistant", "observation", "function", "system"
PROMPT_SIDE = (USER, OBSERVATION)
"""Roles of the turns a sample never trains on (LLaMA-Factory's odd turns)."""
ANSWER_SIDE = (ASSISTANT, FUNCTION)
"""Roles of the turns that are answers (LLaMA-Factory's even turns)."""
ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "model": ASSISTANT,
         "observation": OBSERVATION, "tool": OBSERVATION, "function_call": FUNCTION,
         "function": FUNCTION, "system": SYSTEM}
"""Role names a record may use -> LLaMA-Factory's roles (dataset_info tags map onto these)."""


@dataclass(frozen=True)
class Example:
    """One record as LLaMA-Factory's converter leaves it."""

    where: str
    """``path:line`` of the record."""
    prompt: list[dict[str, str]]
    """Turns before the response (history included), alternating user/observation and
    assistant/function, odd in number for a valid example."""
    response: list[dict[str, str]]
    """One answer (sft), or chosen then rejected (pairwise); empty when there is none."""
    system: str
    """System prompt ('' = the template's default)."""
    tools: str
    """Tool definitions as JSON text ('' = none)."""
    images: tuple[str, ...] = ()
    """The record's image paths, one per ``<image>`` placeholder in order (:mod:`.vision`)."""


def example_of(record: Record, fmt: str, ranking: bool, media_root: str = "") -> Example | None:
    """The example of ``record`` in format ``fmt`` (alpaca or sharegpt); None when it breaks
    sharegpt's turn alternation (LLaMA-Factory drops it). Relative image paths are looked up
    in ``media_root`` first."""
    check_media(record)
    example = None
    if fmt == "alpaca":
        example = _alpaca(record, ranking)
    elif fmt == "sharegpt":
        example = _sharegpt(record, ranking)
    else:
        _bad_format(fmt)
    images = resolve_images(record.data.get("images"), media_root, record.where)
    return dataclasses.replace(example, images=images) if example is not None and images else example


def _bad_format(fmt: str) -> NoReturn:
    raise DataError(f"data.dataset_format={fmt!r} is not a conversation format; valid: alpaca, sharegpt")


def _alpaca(record: Record, ranking: bool) -> Example:
    data = record.data
    if "instruction" not in data:
        raise DataError(f"{record.where}: alpaca record lacks 'instruction'; keys: {sorted(data)}")
    prompt = []
    history = data.get("history")
    if history is not None and not isinstance(history, list):
        raise DataError(f"{record.where}: 'history' must be a list of [prompt, response] pairs, "
                        f"got {type(history).__name__}")
    for pair in history or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise DataError(f"{record.where}: history entries must be [prompt, response] pairs; got {pair!r:.60}")
        prompt += [_message(record, USER, pair[0], "history"), _message(record, ASSISTANT, pair[1], "history")]
    query = [_text(record, key) for key in ("instruction", "input")]
    prompt.append({"role": USER, "content": "\n".join(part for part in query if part)})
    if ranking and isinstance(data.get("chosen"), str) and isinstance(data.get("rejected"), str):
        response = [{"role": ASSISTANT, "content": data["chosen"]},
                    {"role": ASSISTANT, "content": data["rejected"]}]
    elif not ranking and "output" not in data:
        raise DataError(f"{record.where}: alpaca record lacks 'output'; keys: {sorted(data)}")
    else:
        output = _text(record, "output")
        response = [{"role": ASSISTANT, "content": output}] if isinstance(data.get("output"), str) else []
    return Example(record.where, prompt, response, _text(record, "system"), _tools(record))


def _sharegpt(record: Record, ranking: bool) -> Example | None:
    data = record.data
    key = "conversations" if "conversations" in data else "messages"
    turns = data.get(key)
    if not isinstance(turns, list):
        raise DataError(f"{record.where}: sharegpt record needs a list of turns in 'conversations' or "
                        f"'messages'; keys: {sorted(data)}")
    messages = [_turn(record, turn, key) for turn in turns]
    if messages and messages[0]["role"] == SYSTEM:
        system, messages = messages[0]["content"], messages[1:]
    else:
        system = _text(record, "system")
    sides = (PROMPT_SIDE, ANSWER_SIDE)
    broken = any(m["role"] not in sides[i % 2] for i, m in enumerate(messages))
    broken |= len(messages) % 2 != (1 if ranking else 0)
    if broken:
        return None
    if ranking and isinstance(data.get("chosen"), dict) and isinstance(data.get("rejected"), dict):
        answers = [_turn(record, data[side], side) for side in ("chosen", "rejected")]
        for side, answer in zip(("chosen", "rejected"), answers):
            if answer["role"] not in ANSWER_SIDE:
                raise DataError(f"{record.where}: {side!r} must be an answer turn (assistant or function "
                                f"call), got role {answer['role']!r}")
        return Example(record.where, messages, answers, system, _tools(record))
    return Example(record.where, messages[:-1], messages[-1:], system, _tools(record))


def _turn(record: Record, turn: object, key: str) -> dict[str, str]:
    if isinstance(turn, dict) and "from" in turn and "value" in turn:
        role, content = turn["from"], turn["value"]
    elif isinstance(turn, dict) and "role" in turn and "content" in turn:
        role, content = turn["role"], turn["content"]
    else:
        raise DataError(f"{record.where}: a turn of {key!r} must have from/value or role/content; "
                        f"got {turn!r:.80}")
    if role not in ROLES:
        raise DataError(f"{record.where}: unknown role {role!r} in {key!r}; valid: {', '.join(ROLES)}")
    return _message(record, ROLES[role], content, key)


def _message(record: Record, role: str, content: object, key: str) -> dict[str, str]:
    if not isinstance(content, str):
        raise DataError(f"{record.where}: a turn's content in {key!r} must be a string, got "
                        f"{type(content).__name__}")
    return {"role": role, "content": content}


def _text(record: Record, key: str) -> str:
    """A string field ('' when absent or null); anything else is bad input."""
    value = record.data.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{record.where}: {key!r} must be a string, got {type(value).__name__}")
    return value


def _tools(record: Record) -> str:
    """Tool definitions as JSON text: a string as written, a list or object serialized."""
    value = record.data.get("tools")
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    raise DataError(f"{record.where}: 'tools' must be JSON text or a list of tool definitions, "
                    f"got {type(value).__name__}")


def check_kto(record: Record) -> None:
    """kto's feedback column read by another stage: refused in one line (the answer would
    train whatever its tag says)."""
    if "kto_tag" in record.data:
        raise DataError(f"{record.where}: kto_tag (unpaired feedback) is read by finetuning.stage='kto' "
                        "only; valid: stage kto, or sft records / chosen-rejected pairs for dpo")
