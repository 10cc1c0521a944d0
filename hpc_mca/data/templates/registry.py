"""The named templates: LLaMA-Factory 0.9.5's slot strings, stop words and flags, one entry each.

:func:`define` fills what an entry leaves out the way LLaMA-Factory's registration does: user
and system default to the bare content, the answer to content + eos (content alone with
``efficient_eos``), tool calls to the answer's slots, observations to the user's slots.
"""

from __future__ import annotations

from typing import Any, TypedDict, Unpack

from .slots import BOS, EOS, Format, FunctionFormat, Slot
from .template import SlotTemplate, VisionTokens

_CHATML_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_CHATML_ASSISTANT = "{{content}}<|im_end|>\n"
_CHATML_SYSTEM = "<|im_start|>system\n{{content}}<|im_end|>\n"
_QWEN_OBSERVATION = ("<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n"
                     "<|im_start|>assistant\n")
_GEMMA_USER = "<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n"
_GEMMA_OBSERVATION = "<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n"
_LLAMA3_TURN = "<|start_header_id|>{role}<|end_header_id|>\n\n{{{{content}}}}<|eot_id|>"
_LLAMA3_ANSWER = "<|start_header_id|>assistant<|end_header_id|>\n\n"


class Flags(TypedDict, total=False):
    """The settings of a :class:`SlotTemplate` besides its formats (its fields say what each does)."""

    tool_format: str
    default_system: str
    stop_words: tuple[str, ...]
    thought_words: tuple[str, str]
    tool_call_words: tuple[str, str]
    replace_eos: bool
    replace_jinja_template: bool
    fold_system: bool
    reasoning: bool
    vision: VisionTokens
    enable_thinking: bool | None
    preserve_thinking: bool


def define(name: str, *, user: tuple[Slot, ...] | None = None, assistant: tuple[Slot, ...] | None = None,
           system: tuple[Slot, ...] | None = None, function: tuple[Slot, ...] | None = None,
           observation: tuple[Slot, ...] | None = None, prefix: tuple[Slot, ...] = (),
           efficient_eos: bool = False, **flags: Unpack[Flags]) -> SlotTemplate:
    """A registry entry, with LLaMA-Factory's defaults for the formats not given."""
    answer_default: tuple[Slot, ...] = ("{{content}}",) if efficient_eos else ("{{content}}", EOS)
    user_format = Format(user) if user else Format()
    return SlotTemplate(
        name=name,
        user=user_format,
        assistant=Format(assistant or answer_default),
        system=Format(system) if system else Format(),
        function=FunctionFormat(function or assistant or answer_default),
        observation=Format(observation) if observation else user_format,
        prefix=Format(prefix),
        efficient_eos=efficient_eos,
        **flags,
    )


_QWEN_FAMILY: dict[str, Any] = {
    "user": (_CHATML_USER,), "assistant": (_CHATML_ASSISTANT,), "system": (_CHATML_SYSTEM,),
    "function": (_CHATML_ASSISTANT,), "observation": (_QWEN_OBSERVATION,), "tool_format": "qwen",
    "stop_words": ("<|im_end|>",), "replace_eos": True,
}
_GEMMA_FAMILY: dict[str, Any] = {
    "user": (_GEMMA_USER,), "assistant": ("{{content}}<end_of_turn>\n",), "system": ("{{content}}\n\n",),
    "observation": (_GEMMA_OBSERVATION,), "prefix": (BOS,), "stop_words": ("<end_of_turn>",), "replace_eos": True,
    "fold_system": True,
}

REGISTRY: dict[str, SlotTemplate] = {template.name: template for template in (
    define("alpaca", user=("### Instruction:\n{{content}}\n\n### Response:\n",), assistant=("{{content}}", EOS, "\n\n"),
           default_system=("Below is an instruction that describes a task. "
                           "Write a response that appropriately completes the request.\n\n"),
           replace_jinja_template=True),
    define("chatml", user=(_CHATML_USER,), assistant=(_CHATML_ASSISTANT,), system=(_CHATML_SYSTEM,),
           observation=("<|im_start|>tool\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
           stop_words=("<|im_end|>", "<|im_start|>"), replace_eos=True, replace_jinja_template=True),
    define("deepseek3", user=("<｜User｜>{{content}}<｜Assistant｜>",), prefix=(BOS,)),
    define("default", user=("Human: {{content}}", EOS, "\nAssistant:"), assistant=("{{content}}", EOS, "\n"),
           system=("System: {{content}}", EOS, "\n"), replace_jinja_template=True),
    define("empty", assistant=("{{content}}",)),
    define("gemma", **_GEMMA_FAMILY),
    define("gemma3", **_GEMMA_FAMILY),
    define("glm4", user=("<|user|>\n{{content}}<|assistant|>",), assistant=("\n{{content}}",),
           system=("<|system|>\n{{content}}",), function=("{{content}}",),
           observation=("<|observation|>\n{{content}}<|assistant|>",), prefix=("[gMASK]<sop>",),
           tool_format="glm4", stop_words=("<|user|>", "<|observation|>"), efficient_eos=True),
    define("llama2", user=(BOS, "[INST] {{content}} [/INST]"), system=("<<SYS>>\n{{content}}\n<</SYS>>\n\n",),
           fold_system=True),
    define("llama3", user=(_LLAMA3_TURN.format(role="user") + _LLAMA3_ANSWER,), assistant=("{{content}}<|eot_id|>",),
           system=(_LLAMA3_TURN.format(role="system"),), function=("{{content}}<|eot_id|>",),
           observation=(_LLAMA3_TURN.format(role="ipython") + _LLAMA3_ANSWER,), prefix=(BOS,),
           tool_format="llama3", stop_words=("<|eot_id|>", "<|eom_id|>"), replace_eos=True),
    define("mistral", user=("[INST] {{content}}[/INST]",), assistant=(" {{content}}", EOS),
           system=("{{content}}\n\n",), function=("[TOOL_CALLS] {{content}}", EOS),
           observation=("""[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]""",), prefix=(BOS,),
           tool_format="mistral", fold_system=True),
    define("phi", user=("<|user|>\n{{content}}<|end|>\n<|assistant|>\n",), assistant=("{{content}}<|end|>\n",),
           system=("<|system|>\n{{content}}<|end|>\n",), stop_words=("<|end|>",), replace_eos=True),
    define("phi4", user=("<|im_start|>user<|im_sep|>{{content}}<|im_end|><|im_start|>assistant<|im_sep|>",),
           assistant=("{{content}}<|im_end|>",), system=("<|im_start|>system<|im_sep|>{{content}}<|im_end|>",),
           stop_words=("<|im_end|>",), replace_eos=True),
    define("qwen", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
           **_QWEN_FAMILY),
    define("qwen2_vl", default_system="You are a helpful assistant.", vision=VisionTokens("qwen2_vl"),
           **_QWEN_FAMILY),
    define("qwen3", reasoning=True, **_QWEN_FAMILY),
    define("qwen3_nothink", **_QWEN_FAMILY),
    define("qwen3_vl", reasoning=True, vision=VisionTokens("qwen3_vl"), **_QWEN_FAMILY),
    define("qwen3_vl_nothink", vision=VisionTokens("qwen3_vl"), **_QWEN_FAMILY),
    define("vicuna", user=("USER: {{content}} ASSISTANT:",),
           default_system=("A chat between a curious user and an artificial intelligence assistant. "
                           "The assistant gives helpful, detailed, and polite answers to the user's questions."),
           replace_jinja_template=True),
)}
"""Every slot template by name (``chat`` and ``plain`` live in :mod:`.chat`)."""
