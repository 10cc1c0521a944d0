"""The bundled demo task: multi-digit addition as SFT (``"12+345="`` -> ``"357"``), and the
subtraction the LoRA demo teaches the addition model (``"345-12="`` -> ``"333"``).

:func:`make_problems` draws operand pairs deterministically (the number of digits of each
operand is uniform, so short and long numbers are equally common); ``hpc_mca/assets/demo/
make_demo.py`` writes them as alpaca jsonl. Its evaluation metric,
teacher-forced exact match of the answer, is general and lives in
:mod:`hpc_mca.loop.exact_match`.
"""

from __future__ import annotations

import random
from pathlib import Path

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
    problems: list[tuple[int, int]] = []
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
