"""The two templates that are not LLaMA-Factory's: ``chat`` and ``plain``.

``chat`` renders the conversation with the tokenizer's own chat_template (jinja, through
``apply_chat_template``) exactly as the model's authors wrote it, tokenizes the whole text once
and cuts the tokens into turns by character offsets: each answer spans from the end of the
conversation rendered up to its prompt (with the generation prompt) to the end of the
conversation rendered up to the answer itself; a token belongs to the side its first
character falls on. ``plain`` concatenates system + newline, prompts, and answers each followed
by the eos, cut the same way.

How ``chat`` differs from LLaMA-Factory's behaviour with no template named (``parse_template``,
which guesses slot strings by rendering placeholder conversations and then encodes slot by slot):

- merges: the text is tokenized in one piece, so a token may cross a slot boundary where
  LLaMA-Factory's per-slot encoding would split it (none do on chatml-like templates, whose
  boundaries sit next to special tokens);
- the jinja is run on the real conversation: templates that render turns differently by
  position, or that LLaMA-Factory's guess misreads, come out as the jinja says;
- no empty thought block is added to answers, even when the jinja contains ``<think>``
  (LLaMA-Factory then switches to its reasoning behaviour);
- tool calls and tool results are refused: their rendering is specific to each model's jinja,
  so a named template with a tool format is needed.

Both fix the tokenizer as LLaMA-Factory does with no template named (eos added as
``<|endoftext|>`` when missing, pad = eos when missing); neither touches its chat_template.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from hpc_mca.data.errors import DataError

from .template import Message, Template, Turn, fix_special_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Spans = list[tuple[int, int]]


def _refuse_tools(name: str, tools: str | None, messages: list[Message]) -> None:
    from .registry import REGISTRY

    tool_roles = sorted({m["role"] for m in messages} & {"function", "observation"})
    if tools or tool_roles:
        what = "tools" if tools else f"{tool_roles[0]} messages"
        raise DataError(f"data.template={name!r} cannot encode {what}; valid: a named template, each has a "
                        f"tool format ({', '.join(REGISTRY)})")


def cut_turns(tokenizer: PreTrainedTokenizerBase, text: str, answers: Spans) -> list[Turn]:
    """``(prompt ids, answer ids)`` per answer span of ``text``, tokenized in one piece."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]
    turns, at = [], 0
    for number, (begin, end) in enumerate(answers):
        # Whatever the template emits after the last answer stays with it (it is not a prompt).
        end = len(text) + 1 if number == len(answers) - 1 else end
        prompt_end = at
        while prompt_end < len(ids) and starts[prompt_end] < begin:
            prompt_end += 1
        answer_end = prompt_end
        while answer_end < len(ids) and starts[answer_end] < end:
            answer_end += 1
        turns.append((list(ids[at:prompt_end]), list(ids[prompt_end:answer_end])))
        at = answer_end
    return turns


class ChatTemplate(Template):
    """The tokenizer's own chat_template (``data.template: chat``)."""

    def __init__(self, default_system: str | None = None) -> None:
        self.name, self.efficient_eos, self.preserve_thinking = "chat", False, False
        self.default_system = default_system or ""

    def render(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message],
               system: str | None) -> tuple[str, Spans]:
        """The conversation's text and its answers' character spans."""
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("data.template='chat' but the tokenizer has no chat_template; valid: plain, "
                            "a named template, or a tokenizer with a chat template")
        system = system or self.default_system
        full = ([{"role": "system", "content": system}] if system else []) + list(messages)
        offset = len(full) - len(messages)

        def chat(upto: int, generation_prompt: bool) -> str:
            # Not tokenized: the rendered text.
            return cast(str, tokenizer.apply_chat_template(full[:upto], tokenize=False,
                                                           add_generation_prompt=generation_prompt))

        text, spans = chat(len(full), False), []
        for index in range(offset + 1, len(full), 2):
            before, after = chat(index, True), chat(index + 1, False)
            if not (after.startswith(before) and text.startswith(after)):
                turn = (index - offset) // 2 + 1
                raise DataError(f"the chat template does not render turn {turn} as a prefix of the "
                                "whole conversation, so its answer cannot be located; valid: a prefix-stable "
                                "chat_template, plain, or a named template")
            spans.append((len(before), len(after)))
        return text, spans

    def encode_multiturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                         tools: str | None, discard_history_thought: bool = False) -> list[Turn]:
        _refuse_tools(self.name, tools, messages)
        return cut_turns(tokenizer, *self.render(tokenizer, messages, system))


class PlainTemplate(Template):
    """Plain concatenation (``data.template: plain``): system + newline, prompts, answers + eos."""

    def __init__(self, default_system: str | None = None) -> None:
        self.name, self.efficient_eos, self.preserve_thinking = "plain", False, False
        self.default_system = default_system or ""

    def render(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message],
               system: str | None) -> tuple[str, Spans]:
        eos = tokenizer.eos_token or ""
        system = system or self.default_system
        text, spans = system + "\n" if system else "", []
        for message in messages:
            if message["role"] == "assistant":
                spans.append((len(text), len(text) + len(message["content"]) + len(eos)))
                text += message["content"] + eos
            else:
                text += message["content"]
        return text, spans

    def encode_multiturn(self, tokenizer: PreTrainedTokenizerBase, messages: list[Message], system: str | None,
                         tools: str | None, discard_history_thought: bool = False) -> list[Turn]:
        _refuse_tools(self.name, tools, messages)
        return cut_turns(tokenizer, *self.render(tokenizer, messages, system))


def tokenizer_template(name: str, tokenizer: PreTrainedTokenizerBase, default_system: str | None,
                       tool_format: str | None) -> Template:
    """``chat`` or ``plain``, with the tokenizer fixed like LLaMA-Factory's no-template path."""
    if tool_format is not None:
        raise DataError(f"data.tool_format={tool_format!r} needs a named template; data.template={name!r} "
                        "encodes no tool calls")
    fix_special_tokens(tokenizer, (), False, name)
    return ChatTemplate(default_system) if name == "chat" else PlainTemplate(default_system)
