"""hpc_mca.data.templates against LLaMA-Factory 0.9.5 itself: same token ids, same fixed tokenizer.

Every named template is run on every conversation below under every configuration
(thinking on/off/None, a default_system override, preserve_thinking, each tool_format), with
two tokenizers: the demo's character-level one (has a pad and a chat_template, no bos) and a
byte-level BPE trained here on text full of the templates' own strings (so merges across slot
boundaries would show), which has a bos, no pad and no chat_template. Each side gets its own
freshly loaded tokenizer, because both fix it in place.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import lf_peer
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hpc_mca.data.addition import DEMO_DIR
from hpc_mca.data.errors import DataError
from hpc_mca.data.templates import TEMPLATE_NAMES, TOOL_FORMAT_NAMES, get_template
from hpc_mca.data.templates.registry import REGISTRY

NAMED = tuple(name for name in TEMPLATE_NAMES if name not in ("chat", "plain"))

TOOLS = json.dumps([
    {"name": "get_weather", "description": "Current weather of a city.",
     "parameters": {"type": "object", "required": ["city"], "properties": {
         "city": {"type": "string", "description": "City name"},
         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}},
    {"type": "function", "function": {"name": "search", "description": "Web search.", "parameters": {
        "type": "object", "properties": {"queries": {"type": "array", "items": {"type": "string"}}}}}},
])
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
THOUGHT = "<think>\nThe user wants {{idx}} facts.\n</think>\n\n"


def _chat(*contents: str, roles: tuple[str, ...] = ()) -> list[dict[str, str]]:
    roles = roles or ("user", "assistant") * (len(contents) // 2)
    return [{"role": role, "content": content} for role, content in zip(roles, contents)]


# (label, messages, system, tools)
CONVERSATIONS: list[tuple[str, list[dict[str, str]], str | None, str | None]] = [
    ("alpaca", _chat("Give three tips for staying healthy.\nBe short.", "Eat well, sleep, move."), None, None),
    ("multi-turn+system", _chat("Hi there", "Hello! How can I help?", "Name a café in O'Hare's town {{idx}}.",
                                " The naïve one.", "Thanks", "You're welcome."), "You are a terse assistant.", None),
    ("empty system", _chat("Who are you?", "A model."), "", None),
    ("tool call", _chat("What's the weather in Paris?", CALL, '{"temperature": 21}', "It is 21 °C in Paris.",
                        roles=("user", "function", "observation", "assistant")), "Use tools well.", TOOLS),
    ("tool call, no system", _chat("Weather?", f"{THOUGHT}{CALL}", '"sunny"', "Sunny.",
                                   roles=("user", "function", "observation", "assistant")), None, TOOLS),
    ("wrapped tool call", _chat("Weather?", f"Let me check.\n<tool_call>{CALL}</tool_call>", "21", "21 degrees.",
                                roles=("user", "function", "observation", "assistant")), "", "[]"),
    ("parallel calls", _chat("Paris and Rome?", f"[{CALL}, {CALL.replace('Paris', 'Rome')}]", "[21, 25]", "Warm.",
                             roles=("user", "function", "observation", "assistant")), None, TOOLS),
    ("thoughts", _chat("Q1", f"{THOUGHT}A1", "Q2", "A2", "Q3", "<think>\nshort\n</think>\n\nA3"), "Think.", None),
    ("no thoughts", _chat("Q1", "A1", "Q2", "A2"), None, None),
]
CONFIGS: list[dict[str, Any]] = [
    {}, {"enable_thinking": False}, {"enable_thinking": None}, {"default_system": "Answer in French."},
    {"preserve_thinking": True}, *({"tool_format": name} for name in TOOL_FORMAT_NAMES),
]


# --- tokenizers ---------------------------------------------------------------------------------


def _corpus() -> str:
    """Text full of the templates' slot strings around conversation contents (a few KB)."""
    pieces = []
    for template in REGISTRY.values():
        for fmt in (template.user, template.assistant, template.system, template.observation, template.function):
            for slot in fmt.slots:
                if isinstance(slot, str):
                    pieces += [slot.replace("{{content}}", text) for text in ("Hello world", "What is 2+2?")]
    for _, messages, system, _ in CONVERSATIONS:
        pieces += [system or ""] + [message["content"] for message in messages]
    pieces.append(TOOLS)
    return "\n".join(pieces) * 2


@cache
def _bpe_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_corpus().split("\n\n"), trainer)
    return tokenizer.to_str()


def demo_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(DEMO_DIR)


def bpe_tokenizer() -> Any:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe_json()), bos_token="<s>",
                                   eos_token="</s>")


TOKENIZERS = {"demo": demo_tokenizer, "bpe": bpe_tokenizer}


def _state(tokenizer: Any) -> tuple:
    """Everything about a tokenizer that changes ids or what is saved with it."""
    return (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token, tokenizer.pad_token_id,
            tokenizer.bos_token, len(tokenizer), sorted(tokenizer.get_added_vocab().items()),
            sorted(tokenizer.all_special_tokens), tokenizer.chat_template, tokenizer.backend_tokenizer.to_str())


def test_bpe_merges_cross_slot_strings():
    """The trained BPE has merges spanning characters of the slot strings (else the test proves less)."""
    ids = bpe_tokenizer().encode("### Instruction:\nHello world\n\n### Response:\n", add_special_tokens=False)
    assert len(ids) < 20


# --- parity with LLaMA-Factory --------------------------------------------------------------------


def _run(encode: Any, *args: Any) -> Any:
    try:
        return ("ok", encode(*args))
    except (DataError, ValueError, RuntimeError, KeyError) as err:  # LLaMA-Factory's own error types
        return ("error", type(err).__name__)


def _compare(ours: Any, lf: Any, tok_ours: Any, tok_lf: Any) -> int:
    compared = 0
    for label, messages, system, tools in CONVERSATIONS:
        for discard in (False, True):
            got = _run(ours.encode_multiturn, tok_ours, messages, system, tools, discard)
            want = _run(lf.encode_multiturn, tok_lf, messages, system, tools, discard)
            _check(got, want, f"{label} multiturn discard={discard}")
            compared += 1
        got = _run(ours.encode_oneturn, tok_ours, messages, system, tools)
        want = _run(lf.encode_oneturn, tok_lf, messages, system, tools)
        _check(got, want, f"{label} oneturn")
        compared += 1
    return compared


def _check(got: Any, want: Any, where: str) -> None:
    if want[0] == "error":
        assert got == ("error", "DataError"), f"{where}: LLaMA-Factory raised {want[1]}, we gave {got}"
    else:
        assert got == want, where


@pytest.mark.parametrize("tokenizer", sorted(TOKENIZERS))
@pytest.mark.parametrize("name", NAMED)
def test_named_template_matches_llamafactory(name: str, tokenizer: str):
    compared = 0
    for config in CONFIGS:
        tok_ours, tok_lf = TOKENIZERS[tokenizer](), TOKENIZERS[tokenizer]()
        ours = get_template(name, tok_ours, **config)
        lf = lf_peer.lf_get_template_and_fix_tokenizer(tok_lf, template=name, **config)
        assert _state(tok_ours) == _state(tok_lf), f"{name} {config}: fixed tokenizer"
        assert ours.efficient_eos == lf.efficient_eos
        compared += _compare(ours, lf, tok_ours, tok_lf)
    assert compared == len(CONFIGS) * len(CONVERSATIONS) * 3 == 270


def test_every_template_was_compared():
    """The parametrization covers all names (20 named templates, two tokenizers)."""
    assert len(NAMED) == 20 and set(NAMED) <= set(lf_peer.LF_TEMPLATES)


def test_reasoning_cases_are_exercised():
    """qwen3's empty-thought rule moves ids between prompt and answer (not a no-op in these samples)."""
    messages = CONVERSATIONS[-1][1]
    thinking = get_template("qwen3", demo_tokenizer()).encode_multiturn(demo_tokenizer(), messages, None, None)
    quiet = get_template("qwen3", demo_tokenizer(), enable_thinking=None).encode_multiturn(
        demo_tokenizer(), messages, None, None)
    assert thinking != quiet and [len(p) + len(a) for p, a in thinking] == [len(p) + len(a) for p, a in quiet]


# --- chat: the tokenizer's own jinja -----------------------------------------------------------------

CHATML_JINJA = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# LLaMA-Factory's parse_template guesses slots that reproduce these jinjas exactly, so chat must equal it
# on user/assistant conversations. Where it legitimately differs (see hpc_mca/data/templates/chat.py):
# tool messages are refused, no empty thought is added, and a user message containing "{{idx}}" keeps it
# (LLaMA-Factory's slot filling replaces it by the turn number; the jinja does not).
CHAT_CONVERSATIONS = [c for c in CONVERSATIONS
                      if not c[3] and not any(m["role"] == "user" and "{{idx}}" in m["content"] for m in c[1])]


def _with_jinja(factory: Any, jinja: str | None) -> Any:
    tokenizer = factory()
    if jinja is not None:
        tokenizer.chat_template = jinja
    return tokenizer


@pytest.mark.parametrize(("tokenizer", "jinja"), [("demo", "chatml"), ("bpe", "chatml"), ("demo", "own")])
def test_chat_matches_llamafactory_parse(tokenizer: str, jinja: str):
    source = CHATML_JINJA if jinja == "chatml" else None
    compared = 0
    for config in ({}, {"default_system": "Answer in French."}):
        tok_ours, tok_lf = _with_jinja(TOKENIZERS[tokenizer], source), _with_jinja(TOKENIZERS[tokenizer], source)
        ours = get_template("chat", tok_ours, **config)
        lf = lf_peer.lf_get_template_and_fix_tokenizer(tok_lf, template=None, **config)
        assert type(lf).__name__ == "Template"  # parsed, not the "empty" fallback, not reasoning
        assert _state(tok_ours) == _state(tok_lf)
        for label, messages, system, tools in CHAT_CONVERSATIONS:
            for system_here in (system, "A system."):
                got = ours.encode_multiturn(tok_ours, messages, system_here, tools)
                assert got == lf.encode_multiturn(tok_lf, messages, system_here, tools), label
                got = ours.encode_oneturn(tok_ours, messages, system_here, tools)
                assert got == lf.encode_oneturn(tok_lf, messages, system_here, tools), label
                compared += 2
    assert compared == 2 * len(CHAT_CONVERSATIONS) * 2 * 2 == 32


def test_chat_keeps_what_llamafactory_rewrites():
    """The documented difference: "{{idx}}" in a user message stays as written."""
    tokenizer = _with_jinja(demo_tokenizer, CHATML_JINJA)
    chat = get_template("chat", tokenizer)
    turns = chat.encode_multiturn(tokenizer, _chat("count {{idx}}", "ok"), None, None)
    assert "count {{idx}}<|im_end|>" in tokenizer.decode(turns[0][0])


def test_chat_refusals():
    tokenizer = demo_tokenizer()
    chat = get_template("chat", tokenizer)
    with pytest.raises(DataError, match="cannot encode tools; valid: a named template"):
        chat.encode_multiturn(tokenizer, CONVERSATIONS[0][1], None, TOOLS)
    with pytest.raises(DataError, match="cannot encode function messages"):
        chat.encode_multiturn(tokenizer, CONVERSATIONS[3][1], None, None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}.{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="does not render turn 1 as a prefix"):
        chat.encode_multiturn(tokenizer, CONVERSATIONS[1][1], None, None)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match="has no chat_template"):
        chat.encode_multiturn(tokenizer, CONVERSATIONS[0][1], None, None)
    with pytest.raises(DataError, match="data.tool_format='qwen' needs a named template"):
        get_template("chat", demo_tokenizer(), tool_format="qwen")


def test_chat_cuts_turns_on_the_rendered_text():
    tokenizer = demo_tokenizer()
    messages = CONVERSATIONS[-1][1]
    turns = get_template("chat", tokenizer).encode_multiturn(tokenizer, messages, "Sys", None)
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Sys"}, *messages], tokenize=False)
    assert [token for turn in turns for part in turn for token in part] == tokenizer.encode(text)
    assert [tokenizer.decode(answer) for _, answer in turns] == [m["content"] + "<|end|>" for m in messages[1::2]]


# --- plain ---------------------------------------------------------------------------------------


def test_plain_concatenates_with_eos():
    tokenizer = bpe_tokenizer()
    plain = get_template("plain", tokenizer, default_system="Be brief.")
    assert tokenizer.pad_token == "</s>"  # fixed like LLaMA-Factory's no-template path
    turns = plain.encode_multiturn(tokenizer, _chat("Q1 ", "A1", "Q2 ", "A2"), None, None)
    assert [tokenizer.decode(p) + "|" + tokenizer.decode(a) for p, a in turns] == [
        "Be brief.\nQ1 |A1</s>", "Q2 |A2</s>"]
    prompt, answer = plain.encode_oneturn(tokenizer, _chat("Q1 ", "A1", "Q2 ", "A2"), "S", None)
    assert tokenizer.decode(prompt) == "S\nQ1 A1</s>Q2 " and tokenizer.decode(answer) == "A2</s>"
    with pytest.raises(DataError, match="cannot encode observation messages"):
        plain.encode_multiturn(tokenizer, _chat("x", "y", "z", "w", roles=("observation", "assistant") * 2),
                               None, None)


# --- get_template's own checks ---------------------------------------------------------------------


def test_unknown_names_are_refused_in_one_line():
    with pytest.raises(DataError, match=r"data.template='qwen9' is not a template; valid: chat, plain, alpaca"):
        get_template("qwen9", demo_tokenizer())
    with pytest.raises(DataError, match=r"data.tool_format='xml' is not a tool format; valid: default, glm4"):
        get_template("qwen", demo_tokenizer(), tool_format="xml")


def test_bad_tool_json_is_a_data_error():
    tokenizer = demo_tokenizer()
    qwen = get_template("qwen", tokenizer)
    with pytest.raises(DataError, match="tools column is not valid JSON"):
        qwen.encode_multiturn(tokenizer, CONVERSATIONS[0][1], None, "[{")
    with pytest.raises(DataError, match="must be a JSON list"):
        qwen.encode_multiturn(tokenizer, CONVERSATIONS[0][1], None, '{"name": "f"}')
    with pytest.raises(DataError, match="function_call message is not valid JSON"):
        qwen.encode_multiturn(tokenizer, _chat("q", "not json", roles=("user", "function")), None, None)


def test_efficient_eos_is_exposed():
    """The pipeline refuses train_on_prompt with these, as LLaMA-Factory does."""
    flagged = {name for name in NAMED if get_template(name, demo_tokenizer()).efficient_eos}
    assert flagged == {"glm4"}
    assert not get_template("chat", demo_tokenizer()).efficient_eos


# --- pt: documents as LLaMA-Factory's pretraining processor writes them ----------------------------


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("name", ["llama3", "qwen", "alpaca"])
def test_pt_documents_match_llamafactory(name: str, bos: bool, tmp_path):
    """pt with a named template (llama3's documents end with <|end_of_text|>, qwen's with the
    eos it replaces, alpaca keeps the tokenizer's): each document's tokens, bos included when
    the tokenizer adds one, are LLaMA-Factory's unpacked rows."""
    from llamafactory.data.processor.pretrain import PretrainDatasetProcessor

    from hpc_mca.data.arguments import DataArguments
    from hpc_mca.data.dataset import load_samples

    texts = ["Hello world, what is 2+2?", "The naïve café.\nSecond line.", "x"]
    toks = []
    for _ in range(2):
        tok = bpe_tokenizer()
        tok.add_special_tokens({"additional_special_tokens": ["<|end_of_text|>"]})
        tok.add_bos_token = bos
        toks.append(tok)
    ours, theirs = toks
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = DataArguments(template=name, cutoff_len=64, pt_chunking="document",
                         preprocessing_cache_dir=str(tmp_path / "cache"))
    store = load_samples(str(tmp_path / "c.jsonl"), ours, data, "pt")
    got = [ids.tolist() + [int(labels[-1])] for ids, labels in (store.sample(i) for i in range(len(store)))]
    template = lf_peer.lf_get_template_and_fix_tokenizer(theirs, template=name)
    args = lf_peer.lf_data_args(template=name, cutoff_len=64, packing=False)
    rows = PretrainDatasetProcessor(template=template, tokenizer=theirs, processor=None, data_args=args
                                    ).preprocess_dataset({"_prompt": [[{"role": "user", "content": t}] for t in texts]})
    assert got == rows["input_ids"]
    assert _state(ours)[:-1] == _state(theirs)[:-1]  # (LF's truncating call leaves truncation set)
    assert (got[0][0] == theirs.bos_token_id) == bos
