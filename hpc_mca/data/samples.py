"""Examples to token samples, as LLaMA-Factory 0.9.5's supervised and pairwise processors
build them.

A sample is its token ids (at most ``cutoff_len``) and, per token, the label LLaMA-Factory
gives it (``IGNORE_INDEX`` when untrained). The label is the token itself except after an
answer of an ``efficient_eos`` template, where the first prompt token of the next turn is
labelled eos (the eos is not written between turns, only trained). The one causal shift
(:func:`hpc_mca.data.tokenize.causal_shift`) then gives the (input, label) pairs HF computes
from LLaMA-Factory's sample.

sft (:func:`supervised_sample`): the turns are encoded by the template; each turn gets what is
left of ``cutoff_len`` (``infer_seqlen``: answers under half the budget stay whole, else a short
prompt stays whole, else both shrink in proportion), and the sample is kept however short.
``mask_history`` fills the budget from the last turn backwards and trains only the last answer;
``train_on_prompt`` trains the prompts too. dpo (:func:`pairwise_samples`): the prompt is every
turn before the answer; prompt and the longer answer share one ``infer_seqlen`` split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .conversation import Example
from .errors import DataError
from .tokenize import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .templates import Template


@dataclass(frozen=True)
class Built:
    """One sample before the causal shift."""

    tokens: list[int]
    """Token ids, LLaMA-Factory's ``input_ids``."""
    labels: list[int]
    """LLaMA-Factory's ``labels``: a token id, or IGNORE_INDEX where nothing is trained."""
    truncated: bool
    """Whether ``cutoff_len`` cut anything of the encoded turns."""
    images: tuple[str, ...] = ()
    """Vision-language samples: the image paths, in the order of their tokens."""
    grids: tuple[tuple[int, int, int], ...] = ()
    """Their ``image_grid_thw`` rows (:mod:`.vision`), one per image."""

    def with_images(self, images: tuple[str, ...], grids: tuple[tuple[int, int, int], ...]) -> Built:
        """This sample carrying ``images`` and their ``grids`` (its image tokens' order)."""
        return Built(self.tokens, self.labels, self.truncated, images, grids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, trained, targets)`` for :func:`~hpc_mca.data.tokenize.causal_shift`."""
        labels = np.asarray(self.labels, dtype=np.int64)
        return np.asarray(self.tokens, dtype=np.int32), labels != IGNORE_INDEX, labels.astype(np.int32)


def infer_seqlen(source_len: int, target_len: int, budget: int) -> tuple[int, int]:
    """Tokens of prompt and answer kept within ``budget`` (LLaMA-Factory's rule): an answer
    under half the budget keeps everything it has; else a prompt under half the budget stays
    whole and the answer gets the rest; else both shrink in proportion to their lengths."""
    if 2 * target_len < budget:
        most_target = budget
    elif 2 * source_len < budget:
        most_target = budget - source_len
    else:
        most_target = int(budget * (target_len / (source_len + target_len)))
    keep_target = min(most_target, target_len)
    return min(max(budget - keep_target, 0), source_len), keep_target


def is_supervised(example: Example) -> bool:
    """The shape LLaMA-Factory's supervised processor accepts: odd prompt, one answer."""
    return len(example.prompt) % 2 == 1 and len(example.response) == 1


def is_pairwise(example: Example) -> bool:
    """The shape LLaMA-Factory's pairwise processor accepts: odd prompt, two answers or more."""
    return len(example.prompt) % 2 == 1 and len(example.response) >= 2


def supervised_sample(template: Template, tokenizer: PreTrainedTokenizerBase, example: Example, cutoff_len: int, *,
                      train_on_prompt: bool = False, mask_history: bool = False) -> Built:
    """LLaMA-Factory's sft sample of a (valid) example."""
    drop_thoughts = mask_history and not getattr(template, "preserve_thinking", False)
    turns = template.encode_multiturn(tokenizer, example.prompt + example.response, example.system or None,
                                      example.tools or None, drop_thoughts)
    eos = tokenizer.eos_token_id
    efficient = bool(template.efficient_eos)
    used = 1 if efficient else 0
    if mask_history:
        turns = turns[::-1]  # the last turn gets the budget first
    tokens: list[int] = []
    labels: list[int] = []
    truncated = False
    for index, (source, target) in enumerate(turns):
        if used >= cutoff_len:
            truncated = True
            break
        keep_source, keep_target = infer_seqlen(len(source), len(target), cutoff_len - used)
        truncated |= keep_source < len(source) or keep_target < len(target)
        source, target = list(source[:keep_source]), list(target[:keep_target])
        used += keep_source + keep_target
        if train_on_prompt:
            source_labels = source
        elif efficient and index != 0 and keep_source:
            source_labels = [eos] + [IGNORE_INDEX] * (keep_source - 1)
        else:
            source_labels = [IGNORE_INDEX] * keep_source
        target_labels = [IGNORE_INDEX] * keep_target if mask_history and index != 0 else target
        if mask_history:
            tokens, labels = source + target + tokens, source_labels + target_labels + labels
        else:
            tokens, labels = tokens + source + target, labels + source_labels + target_labels
    if efficient:
        tokens, labels = tokens + [eos], labels + [eos]
    return Built(tokens, labels, truncated)


def pairwise_samples(template: Template, tokenizer: PreTrainedTokenizerBase, example: Example,
                     cutoff_len: int) -> tuple[Built, Built]:
    """LLaMA-Factory's chosen and rejected samples of a (valid) pairwise example."""
    system, tools = example.system or None, example.tools or None
    prompt, chosen = template.encode_oneturn(tokenizer, example.prompt + example.response[:1], system, tools)
    _, rejected = template.encode_oneturn(tokenizer, example.prompt + example.response[1:2], system, tools)
    chosen, rejected = list(chosen), list(rejected)
    if template.efficient_eos:
        chosen, rejected = chosen + [tokenizer.eos_token_id], rejected + [tokenizer.eos_token_id]
    longest = max(len(chosen), len(rejected))
    keep_prompt, keep_answer = infer_seqlen(len(prompt), longest, cutoff_len)
    cut = keep_prompt < len(prompt) or keep_answer < longest
    kept = list(prompt[:keep_prompt])
    return tuple(Built(kept + answer[:keep_answer], [IGNORE_INDEX] * keep_prompt + answer[:keep_answer], cut)
                 for answer in (chosen, rejected))  # type: ignore[return-value]


def check_prompt_training(template: Template, train_on_prompt: bool, mask_history: bool = False) -> None:
    """LLaMA-Factory refuses ``train_on_prompt`` with ``mask_history`` (one trains every prompt,
    the other only the last answer) and with an efficient_eos template (its prompts carry the
    previous answer's eos label)."""
    if train_on_prompt and mask_history:
        raise DataError("data.train_on_prompt=true and data.mask_history=true contradict each other "
                        "(every prompt trained, or only the last answer); valid: at most one of them")
    if train_on_prompt and template.efficient_eos:
        raise DataError(f"data.train_on_prompt=true does not work with data.template={template.name!r} "
                        "(an efficient_eos template); valid: train_on_prompt false, or another template")
