"""The bundled demo task: multi-digit addition as SFT (``"12+345="`` -> ``"357"``), and the
subtraction the LoRA demo teaches the addition model (``"345-12="`` -> ``"333"``).

:func:`make_problems` draws operand pairs deterministically (the number of digits of each
operand is uniform, so short and long numbers are equally common); ``hpc_mca/assets/demo/
make_demo.py`` writes them as alpaca jsonl. :func:`response_exact_match` is the task metric the
trainer calls at evaluation: a sample counts as correct when the argmax prediction is right at
every response position (teacher forcing). Because greedy decoding emits exactly the argmax at
each position given a correct prefix, this equals exact match of greedily generated answers,
end-of-turn token included, without a generation loop.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from .tokenize import IGNORE_INDEX

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
"""Where the demo's model config, tokenizer, data and YAML live (package data)."""


def make_problems(count: int, *, seed: int, max_digits: int = 3,
                  exclude: set[tuple[int, int]] | frozenset[tuple[int, int]] = frozenset()
                  ) -> list[tuple[int, int]]:
    """``count`` distinct operand pairs, none of them in ``exclude``."""
    rng = random.Random(seed)
    space = (10 ** max_digits) ** 2
    if count + len(exclude) > space:
        raise ValueError(f"cannot draw {count} distinct problems with {max_digits} digits")
    seen: set[tuple[int, int]] = set()
    problems = []
    while len(problems) < count:
        pair = (_operand(rng, max_digits), _operand(rng, max_digits))
        if pair not in seen and pair not in exclude:
            seen.add(pair)
            problems.append(pair)
    return problems


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


def alpaca_record(a: int, b: int) -> dict[str, str]:
    """The SFT record of ``a + b``."""
    return {"instruction": f"{a}+{b}=", "output": str(a + b)}


def subtraction_record(a: int, b: int) -> dict[str, str]:
    """The SFT record of the larger operand minus the smaller (the LoRA demo's new skill)."""
    high, low = max(a, b), min(a, b)
    return {"instruction": f"{high}-{low}=", "output": str(high - low)}


def preference_record(a: int, b: int) -> dict[str, str]:
    """The dpo pair of ``a + b``: the right sum is chosen; a near miss (one digit of the sum
    off by one, picked from the operands) is rejected."""
    right = str(a + b)
    digit = (a * 7 + b * 3) % len(right)
    wrong = right[:digit] + str((int(right[digit]) + 1 + (a + b) % 8) % 10) + right[digit + 1:]
    return {"instruction": f"{a}+{b}=", "chosen": right, "rejected": wrong}


def response_exact_match(predictions: torch.Tensor, labels: torch.Tensor,
                         attention_mask: torch.Tensor) -> torch.Tensor:
    """``[correct, total]`` (int64) over the samples of a batch.

    ``predictions`` are argmax token ids aligned with ``labels`` (both ``[B, S]``, labels
    already shifted, ``IGNORE_INDEX`` where untrained); ``attention_mask`` numbers the samples
    of each row (packed) or is 1 on real tokens (padded). A sample counts when it has at least
    one trained position; it is correct when every trained position is predicted. The result
    can be all-reduced (summed) across data-parallel ranks.
    """
    trained = labels != IGNORE_INDEX
    docs = int(attention_mask.max()) + 1 if attention_mask.numel() else 1
    rows = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1)
    key = (rows * docs + attention_mask.long()).reshape(-1)
    size = labels.shape[0] * docs
    wrong = torch.zeros(size, dtype=torch.long, device=labels.device)
    wrong.scatter_add_(0, key, ((predictions != labels) & trained).reshape(-1).long())
    has = torch.zeros(size, dtype=torch.long, device=labels.device)
    has.scatter_add_(0, key, trained.reshape(-1).long())
    counted = has > 0
    return torch.stack([(counted & (wrong == 0)).sum(), counted.sum()])
