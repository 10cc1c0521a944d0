"""Conversation records to shifted samples (sft and dpo), in one process or several.

The template is built once per run (:func:`prepare_template`), which also fixes the tokenizer
as LLaMA-Factory does (eos, pad, stop words): everything after it (the tokenizer fingerprint of
the cache key, the pad id of the rows) sees the fixed tokenizer. Records become examples
(:mod:`.conversation`), examples become samples (:mod:`.samples`). With
``data.preprocessing_num_workers`` the examples are cut into that many consecutive chunks,
encoded in forked worker processes and put back in order, so the result is the serial one.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections import Counter
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .arguments import DataArguments
from .conversation import Example, check_kto, example_of
from .errors import DataError
from .multimodal import VisionInputs, check_no_images, vision_pairwise, vision_sample
from .records import Record, detect_sft_format
from .samples import Built, check_prompt_training, is_pairwise, is_supervised, pairwise_samples, supervised_sample
from .store import SampleStore
from .templates import get_template
from .tokenize import causal_shift

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .templates import Template

PT_EOS = {"llama3": "<|end_of_text|>"}
"""Templates whose pt documents end with another token than the (fixed) eos, as in
LLaMA-Factory's pretraining processor."""

_DEFAULTS = {field.name: field.default for field in dataclasses.fields(DataArguments)}
_JOB: dict[str, Any] = {}
"""What forked workers encode: set by the parent just before the pool forks (inherited, so
neither the tokenizer nor the template is pickled)."""


def setting(data: DataArguments, key: str) -> Any:
    """``data.<key>``, or DataArguments' default when ``data`` (a partial namespace) lacks it."""
    return getattr(data, key, _DEFAULTS[key])


def prepare_template(tokenizer: PreTrainedTokenizerBase, data: DataArguments) -> Template:
    """``data.template`` for this tokenizer (fixed in place), checked against train_on_prompt."""
    template = get_template(setting(data, "template"), tokenizer, enable_thinking=setting(data, "enable_thinking"),
                            default_system=setting(data, "default_system"),
                            tool_format=setting(data, "tool_format"))
    check_prompt_training(template, setting(data, "train_on_prompt"), setting(data, "mask_history"))
    return template


def pt_eos_id(tokenizer: PreTrainedTokenizerBase, template_name: str) -> int | None:
    """The id ending a pt document for ``template_name``; None = the tokenizer's eos."""
    token = PT_EOS.get(template_name)
    if token is None:
        return None
    found = cast("int | None", tokenizer.convert_tokens_to_ids(token))  # one token: one id, or None
    if found is None or found == tokenizer.unk_token_id:
        raise DataError(f"data.template={template_name!r} ends pt documents with {token!r}, which this "
                        "tokenizer lacks; valid: the template's own model family, or another template")
    return int(found)


def conversation_format(records: list[Record], data: DataArguments, feedback: bool = False) -> str:
    """``data.dataset_format``, or for auto the format the first record's keys tell; a
    ``kto_tag`` outside stage kto (``feedback``) is refused in one line."""
    if records and not feedback:
        check_kto(records[0])
    fmt = setting(data, "dataset_format")
    return detect_sft_format(records[0]) if fmt == "auto" and records else fmt


def examples_of(records: list[Record], fmt: str, ranking: bool,
                media_root: str = "") -> tuple[list[Example], int]:
    """The examples of ``records`` in the shape the stage's processor accepts, and how many
    records were invalid (broken turn alternation or a missing answer: dropped, as in LLaMA-Factory).
    Relative image paths are looked up in ``media_root`` first."""
    valid = is_pairwise if ranking else is_supervised
    examples = []
    for record in records:
        example = example_of(record, fmt, ranking, media_root)
        if example is not None and valid(example):
            examples.append(example)
    return examples, len(records) - len(examples)


def _encode_chunk(bounds: tuple[int, int]) -> list[tuple[Built, ...]]:
    job = _JOB
    out: list[tuple[Built, ...]] = []
    for example in job["examples"][bounds[0]:bounds[1]]:
        if job["vision"] is not None and job["ranking"]:
            out.append(vision_pairwise(job["template"], job["tokenizer"], example, job["cutoff_len"], job["vision"]))
        elif job["vision"] is not None:
            out.append((vision_sample(job["template"], job["tokenizer"], example, job["cutoff_len"], job["vision"],
                                      train_on_prompt=job["train_on_prompt"], mask_history=job["mask_history"]),))
        elif job["ranking"]:
            out.append(pairwise_samples(job["template"], job["tokenizer"], example, job["cutoff_len"]))
        else:
            out.append((supervised_sample(job["template"], job["tokenizer"], example, job["cutoff_len"],
                                          train_on_prompt=job["train_on_prompt"],
                                          mask_history=job["mask_history"]),))
    return out


def encode_examples(examples: list[Example], tokenizer: PreTrainedTokenizerBase, template: Template,
                    data: DataArguments, ranking: bool, vision: VisionInputs | None = None) -> list[tuple[Built, ...]]:
    """One tuple of samples per example (sft: one; dpo: chosen, rejected), in order; with
    ``vision``, samples with their images (:func:`~.multimodal.vision_sample`,
    :func:`~.multimodal.vision_pairwise`)."""
    _JOB.update(examples=examples, tokenizer=tokenizer, template=template, ranking=ranking, vision=vision,
                cutoff_len=data.cutoff_len, train_on_prompt=setting(data, "train_on_prompt"),
                mask_history=setting(data, "mask_history"))
    try:
        workers = min(setting(data, "preprocessing_num_workers") or 1, max(len(examples), 1))
        step = -(-len(examples) // workers) if examples else 1
        chunks = [(start, start + step) for start in range(0, len(examples), step)]
        if workers <= 1:
            return [built for chunk in chunks for built in _encode_chunk(chunk)]
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return [built for part in pool.map(_encode_chunk, chunks) for built in part]
    finally:
        _JOB.clear()


def _shifted(built: Built) -> tuple[np.ndarray, np.ndarray] | None:
    """The causally shifted sample; None when no label is left to train."""
    input_ids, labels = causal_shift(*built.arrays())
    return (input_ids, labels) if (labels >= 0).any() else None


def conversation_store(records: list[Record], tokenizer: PreTrainedTokenizerBase, template: Template,
                       data: DataArguments, fmt: str, ranking: bool, vision: VisionInputs | None = None,
                       media_root: str = "") -> SampleStore:
    """Shifted samples of sft records (or dpo pairs, chosen and rejected interleaved), with the
    counts the data line reports: records, samples (pairs), invalid, truncated, dropped. With
    ``vision`` (a vision-language template's), samples keep their images (a pair's chosen and
    rejected each all of the example's; ``images`` counts the examples' images); relative image
    paths are looked up in ``media_root`` first."""
    examples, invalid = examples_of(records, fmt, ranking, media_root)
    if vision is None:
        for example in examples:
            check_no_images(example, template)
    counts: Counter[str] = Counter(records=len(records), invalid=invalid, truncated=0, dropped=0)
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    images: list[tuple[tuple[str, ...], np.ndarray]] = []
    for built in encode_examples(examples, tokenizer, template, data, ranking, vision):
        shifted = [_shifted(sample) for sample in built]
        kept = [sample for sample in shifted if sample is not None]
        counts["truncated"] += built[0].truncated
        if len(kept) < len(shifted):
            counts["dropped"] += 1  # nothing left to train (the budget went to earlier turns)
            continue
        samples += kept
        images += [(sample.images, np.asarray(sample.grids, dtype=np.int64).reshape(-1, 3)) for sample in built]
        counts["images"] += len(built[0].images)
    counts["pairs" if ranking else "samples"] = len(samples) // (2 if ranking else 1)
    if vision is None:
        del counts["images"]
        return SampleStore.from_samples(samples, dict(counts))
    return SampleStore.from_samples(samples, dict(counts), images)
