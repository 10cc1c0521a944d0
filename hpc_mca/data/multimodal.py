"""Vision-language sft samples and dpo pairs, as LLaMA-Factory 0.9.5's supervised and pairwise
processors build them with the Qwen2-VL / Qwen3-VL plugin of its ``qwen2_vl`` / ``qwen3_vl``
templates.

Every ``<image>`` of the turns becomes ``<|vision_start|>`` + ``<|image_pad|>`` × n +
``<|vision_end|>``, n the image's ``grid_thw.prod() // merge_size²`` (:mod:`.vision`), and the
turns are then encoded and cut to ``cutoff_len`` as text samples are (:mod:`.samples`). A
pair's chosen and rejected samples each carry all of the example's image tokens (its prompt
with each answer, :func:`vision_pairwise`), so a micro-batch holds an image's pixels once per
sample that uses it.
Where LLaMA-Factory raises (placeholders and images that do not pair up) or would train a
model on a cut image (its tokens no longer match the pixels), the sample is refused in one
line naming it. The tokenization cache keeps each sample's image paths and grids; the pixels
are computed again when a row is read (:meth:`VisionInputs.pixels`), as LLaMA-Factory's
collator does, and checked against the cached grids.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import DataError
from .samples import Built, pairwise_samples, supervised_sample
from .templates import template_vision
from .vision import (
    ImageSettings,
    count_placeholders,
    expand_images,
    image_inputs,
    image_token_counts,
    load_image_processor,
    merge_size,
    processor_digest,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.image_processing_utils import BaseImageProcessor

    from .conversation import Example
    from .templates import Message, Template, VisionTokens

VL_TEMPLATES = ("qwen2_vl", "qwen3_vl", "qwen3_vl_nothink")
"""The templates that read images (named in the one-line refusals)."""


@dataclass(frozen=True)
class VisionInputs:
    """What turns a run's image paths into model inputs: the model's image processor, the
    sizing settings and the template's vision tokens (their ids in the fixed tokenizer)."""

    processor: BaseImageProcessor
    """The model's image processor (transformers' PIL or torchvision backend)."""
    settings: ImageSettings
    tokens: VisionTokens
    image_token_id: int
    """``<|image_pad|>``'s id: the model config's ``image_token_id``."""
    vision_start_id: int
    """``<|vision_start|>``'s id: the model config's ``vision_start_token_id``."""
    merge: int
    """The processor's ``merge_size``: patches per side merged into one image token."""

    def grids(self, paths: tuple[str, ...], where: str) -> np.ndarray:
        """int64 [images, 3]: the ``image_grid_thw`` of the images at ``paths``."""
        return self.pixels(paths, where)[1]

    def pixels(self, paths: tuple[str, ...], where: str) -> tuple[np.ndarray, np.ndarray]:
        """``(pixel_values float32 [patches, C·T·P·P], image_grid_thw int64 [images, 3])``."""
        return image_inputs(self.processor, paths, self.settings, where)

    def cache_settings(self) -> dict[str, Any]:
        """What the tokenization cache key must include for these inputs."""
        return {"processor": processor_digest(self.processor), "image_max_pixels": self.settings.max_pixels,
                "image_min_pixels": self.settings.min_pixels, "vision": dataclasses.asdict(self.tokens)}


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str, template: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == tokenizer.unk_token_id:
        raise DataError(f"data.template={template!r} writes images with {token!r}, which this tokenizer "
                        "lacks; valid: the vision-language model's own tokenizer")
    return found


def vision_inputs(tokenizer: PreTrainedTokenizerBase, template: Template, model_path: str | os.PathLike[str],
                  settings: ImageSettings) -> VisionInputs | None:
    """The vision inputs of a vision-language ``template`` (None for a text-only one): the
    image processor of ``model_path`` and the template's token ids in ``tokenizer``."""
    tokens = template_vision(template)
    if tokens is None:
        return None
    if settings.min_pixels > settings.max_pixels or settings.min_pixels < 1:
        raise DataError(f"data.image_min_pixels={settings.min_pixels} must be between 1 and "
                        f"data.image_max_pixels={settings.max_pixels}")
    processor = load_image_processor(model_path)
    image_id = _token_id(tokenizer, tokens.image, template.name)
    start_id = _token_id(tokenizer, tokens.start, template.name)
    _token_id(tokenizer, tokens.end, template.name)
    return VisionInputs(processor, settings, tokens, image_id, start_id, merge_size(processor))


def check_no_images(example: Example, template: Template | None, reason: str | None = None) -> None:
    """DataError (one line naming the record) for an example with images where they cannot go:
    ``reason`` says why (another stage); by default, the template is text only."""
    if not example.images:
        return
    why = reason or (f"data.template={getattr(template, 'name', None)!r} is text only; valid: a "
                     f"vision-language template ({', '.join(VL_TEMPLATES)})")
    raise DataError(f"{example.where}: the record has {len(example.images)} image(s) but {why}")


def vision_sample(template: Template, tokenizer: PreTrainedTokenizerBase, example: Example, cutoff_len: int,
                  vision: VisionInputs, *, train_on_prompt: bool = False, mask_history: bool = False) -> Built:
    """LLaMA-Factory's sft sample of a (valid) example whose ``<image>`` placeholders take its
    images in order; DataError (one line) when they do not pair up, an image cannot be read or
    its tokens do not fit ``cutoff_len``."""
    messages = example.prompt + example.response
    _check_placeholders(example, messages)
    options = {"train_on_prompt": train_on_prompt, "mask_history": mask_history}
    if not example.images:
        return supervised_sample(template, tokenizer, example, cutoff_len, **options)
    grids = vision.grids(example.images, example.where)
    counts = image_token_counts(grids, vision.merge)
    expanded = expand_images(messages, counts, vision.tokens)
    split = len(example.prompt)
    built = supervised_sample(template, tokenizer, dataclasses.replace(
        example, prompt=expanded[:split], response=expanded[split:]), cutoff_len, **options)
    _check_kept(example, built, counts, cutoff_len, vision)
    return built.with_images(example.images, tuple((int(t), int(h), int(w)) for t, h, w in grids))


def _check_placeholders(example: Example, messages: list[Message]) -> None:
    placeholders = count_placeholders(messages)
    if placeholders != len(example.images):
        raise DataError(f"{example.where}: {placeholders} <image> placeholder(s) in the turns but "
                        f"{len(example.images)} image(s); valid: one image per <image>, in order")


def _check_kept(example: Example, built: Built, counts: list[int], cutoff_len: int, vision: VisionInputs) -> None:
    kept = built.tokens.count(vision.image_token_id)
    if kept != sum(counts):
        raise DataError(f"{example.where}: its {len(counts)} image(s) take {sum(counts)} image tokens, "
                        f"{kept} of which fit data.cutoff_len={cutoff_len}; "
                        "valid: a larger cutoff_len, or smaller images (data.image_max_pixels)")


def vision_pairwise(template: Template, tokenizer: PreTrainedTokenizerBase, example: Example, cutoff_len: int,
                    vision: VisionInputs) -> tuple[Built, Built]:
    """LLaMA-Factory's chosen and rejected samples of a (valid) pairwise example with images:
    the prompt with each answer takes all of the example's images (the placeholders of the
    prompt and that answer pair up with them, in order), so both samples carry the image
    tokens; DataError (one line) as for :func:`vision_sample`, for either sample."""
    sides = [example.prompt + [answer] for answer in example.response[:2]]
    for messages in sides:
        _check_placeholders(example, messages)
    if not example.images:
        return pairwise_samples(template, tokenizer, example, cutoff_len)
    grids = vision.grids(example.images, example.where)
    counts = image_token_counts(grids, vision.merge)
    chosen, rejected = (expand_images(messages, counts, vision.tokens) for messages in sides)
    split = len(example.prompt)
    # The prompt is encoded from the chosen side, as LLaMA-Factory does; each answer from its own.
    pair = pairwise_samples(template, tokenizer, dataclasses.replace(
        example, prompt=chosen[:split], response=[chosen[split], rejected[split]]), cutoff_len)
    rows = tuple((int(t), int(h), int(w)) for t, h, w in grids)
    for built in pair:
        _check_kept(example, built, counts, cutoff_len, vision)
    return pair[0].with_images(example.images, rows), pair[1].with_images(example.images, rows)
