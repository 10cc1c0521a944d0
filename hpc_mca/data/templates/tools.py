"""Tool formats: how a template describes the available tools and writes the assistant's calls.

Each format has two halves: ``describe`` turns the sample's ``tools`` (a JSON list of function
schemas, bare or wrapped as ``{"type": "function", "function": ...}``) into text appended to the
system message, and ``calls`` turns the assistant's ``(name, arguments JSON)`` calls into the
text the model is trained to emit. The prompt strings are LLaMA-Factory 0.9.5's, character for
character, since they end up in the token ids. Only the formats of the templates in
:mod:`.registry` are here (``TOOL_FORMATS``); LLaMA-Factory has more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hpc_mca.data.errors import DataError

Call = tuple[str, str]
"""A tool call: the function's name and its arguments as a JSON string."""

_DEFAULT_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)
_GLM4_PROMPT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}"
)
_LLAMA3_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    """Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. """
    "Do not use variables.\n\n{tool_text}"
)
_QWEN_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The bare function schema of a possibly wrapped tool."""
    return tool.get("function", "") if tool.get("type") == "function" else tool


def _wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool in OpenAI's ``{"type": "function", "function": ...}`` envelope."""
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _dumps(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _default_describe(tools: list[dict[str, Any]]) -> str:
    blocks, names = [], []
    for tool in map(_schema, tools):
        lines = []
        for name, param in tool["parameters"]["properties"].items():
            required = ", required" if name in tool["parameters"].get("required", []) else ""
            enum = ", should be one of [{}]".format(", ".join(param["enum"])) if param.get("enum") else ""
            items = ", where each item should be {}".format(param["items"].get("type", "")) if param.get(
                "items") else ""
            lines.append(f"  - {name} ({param.get('type', '')}{required}): {param.get('description', '')}"
                         f"{enum}{items}\n")
        blocks.append(f"> Tool Name: {tool['name']}\nTool Description: {tool.get('description', '')}\n"
                      f"Tool Args:\n{''.join(lines)}\n")
        names.append(tool["name"])
    return _DEFAULT_PROMPT.format(tool_text="".join(blocks), tool_names=", ".join(names))


def _default_calls(calls: list[Call]) -> str:
    return "\n".join(f"Action: {name}\nAction Input: {arguments}" for name, arguments in calls)


def _glm4_describe(tools: list[dict[str, Any]]) -> str:
    usage = "在调用上述函数时，请使用 Json 格式表示调用的参数。"  # GLM-4's own words, as LLaMA-Factory writes them
    text = "".join(f"\n\n## {tool['name']}\n\n{_dumps(tool, indent=4)}\n{usage}" for tool in map(_schema, tools))
    return _GLM4_PROMPT.format(tool_text=text)


def _glm4_calls(calls: list[Call]) -> str:
    if len(calls) > 1:
        raise DataError(f"tool_format 'glm4' writes one call per message; got {len(calls)} parallel calls")
    name, arguments = calls[0]
    return f"{name}\n{arguments}"


def _llama3_describe(tools: list[dict[str, Any]]) -> str:
    # The date is today's, as in LLaMA-Factory: the same data tokenized on another day differs.
    text = "".join(_dumps(_wrapped(tool), indent=4) + "\n\n" for tool in tools)
    return _LLAMA3_PROMPT.format(date=datetime.now().strftime("%d %b %Y"), tool_text=text)


def _llama3_calls(calls: list[Call]) -> str:
    objects = [{"name": name, "parameters": json.loads(arguments)} for name, arguments in calls]
    return _dumps(objects[0] if len(objects) == 1 else objects)


def _mistral_describe(tools: list[dict[str, Any]]) -> str:
    return "[AVAILABLE_TOOLS] " + _dumps([_wrapped(tool) for tool in tools]) + "[/AVAILABLE_TOOLS]"


def _mistral_calls(calls: list[Call]) -> str:
    return _dumps([{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls])


def _qwen_describe(tools: list[dict[str, Any]]) -> str:
    return _QWEN_PROMPT.format(tool_text="".join("\n" + _dumps(_wrapped(tool)) for tool in tools))


def _qwen_calls(calls: list[Call]) -> str:
    texts = [_dumps({"name": name, "arguments": json.loads(arguments)}) for name, arguments in calls]
    return "\n".join(f"<tool_call>\n{text}\n</tool_call>" for text in texts)


@dataclass(frozen=True)
class ToolFormat:
    """One tool-calling convention."""

    describe: Callable[[list[dict[str, Any]]], str]
    """The tools' description appended to the system message."""
    calls: Callable[[list[Call]], str]
    """The assistant's calls as the model writes them."""


TOOL_FORMATS: dict[str, ToolFormat] = {
    "default": ToolFormat(_default_describe, _default_calls),
    "glm4": ToolFormat(_glm4_describe, _glm4_calls),
    "llama3": ToolFormat(_llama3_describe, _llama3_calls),
    "mistral": ToolFormat(_mistral_describe, _mistral_calls),
    "qwen": ToolFormat(_qwen_describe, _qwen_calls),
}
"""``data.tool_format`` values: every format a registered template uses."""
