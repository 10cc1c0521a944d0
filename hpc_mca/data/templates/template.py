"""Templates: a conversation in, per-turn (prompt ids, answer ids) out, as LLaMA-Factory 0.9.5 does.

A :class:`SlotTemplate` turns each message into slots (:mod:`.slots`) and tokenizes them: the
first message also carries the prefix and the system message (plus the tools' description),
later ones only their own slots. Two variations of LLaMA-Factory are flags here:
``fold_system`` (llama2/gemma/mistral: the system text goes inside the first user message) and
``reasoning`` (qwen3: an empty thought block is added to answers that have none, trained on
when thinking is enabled, part of the prompt otherwise).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpc_mca.data.errors import DataError

from .jinja import slot_template_jinja
from .slots import Format, FunctionFormat, Slot, slots_to_ids
from .tools import TOOL_FORMATS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]
Turn = tuple[list[int], list[int]]


class Template:
    """What the data pipeline codes against: every template name resolves to one of these."""

    # Annotations only: the subclasses set them (a class default would become a dataclass default).
    name: str
    efficient_eos: bool
    """The eos is appended once at the end of a sample instead of ending every answer
    (LLaMA-Factory refuses ``train_on_prompt`` with such a template; so does the pipeline)."""
    preserve_thinking: bool
    """Reasoning templates: keep earlier answers' thoughts in ``encode_oneturn`` / ``mask_history``."""

    def encode_multiturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                         tools: str | None, discard_history_thought: bool = False) -> list[Turn]:
        """``(prompt ids, answer ids)`` per turn; ``messages`` alternate prompt side and answer side."""
        raise NotImplementedError

    def encode_oneturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                       tools: str | None) -> Turn:
        """Everything before the last answer as the prompt, and the last answer."""
        turns = self.encode_multiturn(tokenizer, messages, system, tools)
        prompt = [token for prompt_ids, answer_ids in turns[:-1] for token in prompt_ids + answer_ids]
        return prompt + turns[-1][0], turns[-1][1]


def _without_thought(words: tuple[str, str], text: str) -> str:
    """``text`` with every thought block removed (and the newlines that followed the first)."""
    pattern = re.compile(f"{re.escape(words[0])}(.*?){re.escape(words[1])}", re.DOTALL)
    return pattern.sub("", text).lstrip("\n")


def _parse_tools(tools: str) -> list[dict[str, Any]]:
    try:
        parsed = json.loads(tools)
    except json.JSONDecodeError as err:
        raise DataError(f"the tools column is not valid JSON ({err}): {tools[:80]!r}") from None
    if not isinstance(parsed, list) or not all(isinstance(tool, dict) for tool in parsed):
        raise DataError(f"the tools column must be a JSON list of function objects, got {tools[:80]!r}")
    return parsed


@dataclass(frozen=True)
class VisionTokens:
    """How a vision-language template writes an image into the text (LLaMA-Factory's mm plugin
    of the template): ``<image>`` becomes ``bos + image * n + eos``, n from the image's grid."""

    plugin: str
    """LLaMA-Factory's plugin name (``qwen2_vl``, ``qwen3_vl``): both expand an image to
    ``grid.prod() // merge_size**2`` image tokens."""
    image: str = "<|image_pad|>"
    """The token repeated once per merged patch (the model config's ``image_token_id``)."""
    start: str = "<|vision_start|>"
    """Written before an image's tokens."""
    end: str = "<|vision_end|>"
    """Written after them."""


@dataclass(frozen=True)
class SlotTemplate(Template):
    """One of LLaMA-Factory's named templates (the registry's entries are these)."""

    name: str
    user: Format
    """User turns (and observations when ``observation`` is the same)."""
    assistant: Format
    """Answers."""
    system: Format
    """The system message, tools' description included; emitted before the first message."""
    function: FunctionFormat
    """The assistant's tool calls."""
    observation: Format
    """Tool results."""
    prefix: Format = field(default_factory=lambda: Format(()))
    """Emitted once, before everything (typically the bos)."""
    tool_format: str = "default"
    """Key of :data:`.tools.TOOL_FORMATS` describing tools and writing calls."""
    default_system: str = ""
    """System message of a sample that has none."""
    stop_words: tuple[str, ...] = ()
    """End-of-turn tokens; the first becomes the eos when ``replace_eos``, all become special tokens."""
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    """Delimiters of a reasoning block."""
    tool_call_words: tuple[str, str] = ("<tool_call>", "</tool_call>")
    """Delimiters of a tool call inside a function message that also has text around it."""
    efficient_eos: bool = False
    replace_eos: bool = False
    """The tokenizer's eos becomes ``stop_words[0]``."""
    replace_jinja_template: bool = False
    """The tokenizer's chat_template is replaced by this template's even when it has one."""
    fold_system: bool = False
    """The system text goes inside the first user message (llama2 style)."""
    reasoning: bool = False
    """Answers get an empty thought block when they have none (see ``enable_thinking``)."""
    enable_thinking: bool | None = True
    """Reasoning templates: True trains on the added empty thought, False/None puts it in the prompt
    (False also strips existing thoughts)."""
    preserve_thinking: bool = False
    vision: VisionTokens | None = None
    """Vision-language templates: how images are written; None = text only (images refused)."""

    # --- encoding ---------------------------------------------------------------------------

    def _message_slots(self, message: Message, index: int, folded_system: str) -> list[Slot]:
        role, content = message["role"], message["content"]
        if role == "user":
            if self.fold_system:
                return self.user.fill(content=folded_system + content)
            return self.user.fill(content=content, idx=str(index // 2))
        if role == "assistant":
            return self.assistant.fill(content=content)
        if role == "observation":
            return self.observation.fill(content=content)
        if role == "function":
            syntax = TOOL_FORMATS[self.tool_format]
            if self.fold_system:  # LLaMA-Factory passes no delimiters on this path
                return self.function.fill_calls(content, syntax)
            return self.function.fill_calls(content, syntax, self.thought_words, self.tool_call_words)
        raise DataError(f"message role {role!r} is not valid; valid: user, assistant, function, observation")

    def _encode(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                tools: str | None) -> list[list[int]]:
        """Token ids of each message, the first one carrying prefix and system."""
        system = system or self.default_system
        encoded = []
        for index, message in enumerate(messages):
            slots: list[Slot] = []
            folded = ""
            if index == 0:
                slots += self.prefix.fill()
                if system or tools:
                    tools_text = self._describe_tools(tools) if tools else ""
                    system_slots = self.system.fill(content=system + tools_text)
                    if self.fold_system:
                        folded = str(system_slots[0])
                    else:
                        slots += system_slots
            slots += self._message_slots(message, index, folded)
            encoded.append(slots_to_ids(tokenizer, slots))
        return encoded

    def _describe_tools(self, tools: str) -> str:
        parsed = _parse_tools(tools)
        return TOOL_FORMATS[self.tool_format].describe(parsed) if parsed else ""

    def _empty_thought_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        return tokenizer.encode(self.thought_words[0] + self.thought_words[1], add_special_tokens=False)

    def _has_thought(self, text: str) -> bool:
        return self.thought_words[0].strip() in text or self.thought_words[1].strip() in text

    def encode_multiturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                         tools: str | None, discard_history_thought: bool = False) -> list[Turn]:
        if not self.reasoning:
            encoded = self._encode(tokenizer, messages, system, tools)
            return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]
        messages = [dict(message) for message in messages]
        last_answer = len(messages) - 1
        for i in range(1, len(messages), 2):
            if self.enable_thinking is False or (discard_history_thought and i < last_answer):
                messages[i]["content"] = _without_thought(self.thought_words, messages[i]["content"])
        encoded = self._encode(tokenizer, messages, system, tools)
        # With history thoughts discarded only the last answer is completed; otherwise each one.
        answers = [last_answer] if discard_history_thought else range(1, len(messages), 2)
        for i in answers:
            if self._has_thought(messages[i]["content"]):
                continue
            if self.enable_thinking:
                encoded[i] = self._empty_thought_ids(tokenizer) + encoded[i]
            else:
                encoded[i - 1] = encoded[i - 1] + self._empty_thought_ids(tokenizer)
        return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

    def encode_oneturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                       tools: str | None) -> Turn:
        messages = [dict(message) for message in messages]
        last = len(messages) - 1
        if self.reasoning:
            history = range(1, last, 2) if not self.preserve_thinking else ()
            for i in history:
                messages[i]["content"] = _without_thought(self.thought_words, messages[i]["content"])
            if self.enable_thinking is False:
                messages[last]["content"] = _without_thought(self.thought_words, messages[last]["content"])
        encoded = self._encode(tokenizer, messages, system, tools)
        prompt = [token for ids in encoded[:-1] for token in ids]
        answer = encoded[-1]
        if self.reasoning and not self._has_thought(messages[last]["content"]):
            if self.enable_thinking:
                answer = self._empty_thought_ids(tokenizer) + answer
            else:
                prompt = prompt + self._empty_thought_ids(tokenizer)
        return prompt, answer

    # --- the tokenizer ----------------------------------------------------------------------

    def fix_tokenizer(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Bring the tokenizer to the state LLaMA-Factory leaves it in for this template."""
        fix_special_tokens(tokenizer, self.stop_words, self.replace_eos, self.name)
        if tokenizer.chat_template is None or self.replace_jinja_template:
            rendered = slot_template_jinja(self, tokenizer)
            if rendered is not None:
                tokenizer.chat_template = rendered


def _set_eos(tokenizer: PreTrainedTokenizerBase, eos_token: str) -> None:
    if tokenizer.eos_token != eos_token:
        tokenizer.add_special_tokens({"eos_token": eos_token})


def fix_special_tokens(tokenizer: PreTrainedTokenizerBase, stop_words: tuple[str, ...], replace_eos: bool,
                       name: str) -> None:
    """eos replaced by the first stop word (``replace_eos``) or added when missing, pad = eos when
    missing, the remaining stop words added as special tokens, as LLaMA-Factory does.

    New tokens may fall outside the model's embedding; the pipeline refuses such ids later.
    """
    if replace_eos:
        if not stop_words:
            raise DataError(f"template {name!r} replaces the eos but has no stop words")
        _set_eos(tokenizer, stop_words[0])
        stop_words = stop_words[1:]
    if tokenizer.eos_token_id is None:
        _set_eos(tokenizer, "<|endoftext|>")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if stop_words:
        try:
            # transformers < 5's keyword; 5 names it replace_extra_special_tokens and raises here.
            tokenizer.add_special_tokens({"additional_special_tokens": list(stop_words)},
                                         replace_additional_special_tokens=False)  # type: ignore[call-arg]
        except TypeError:  # tokenizers without that keyword
            tokenizer.add_special_tokens({"additional_special_tokens": list(stop_words)})
