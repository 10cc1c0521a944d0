"""Images of vision-language samples, read and sized as LLaMA-Factory 0.9.5's Qwen2-VL and
Qwen3-VL plugins read them, and the model's own image processor that turns them into patches.

A record's ``images`` (a path or a list of paths) are found as LLaMA-Factory finds them: a path
relative to the media directory (``data.media_dir``, else ``data.dataset_dir``; a direct dataset
path: its file's directory) when that file exists, else the path as written (absolute, or
relative to the working directory). Each ``<image>`` placeholder of the conversation takes the
next image, in order; the counts must agree.

Before the processor sees an image it is sized as LLaMA-Factory sizes it
(:func:`regularize`): scaled down (keeping its aspect) to at most ``data.image_max_pixels``
pixels, up to at least ``data.image_min_pixels``, converted to RGB, each side at least 28
pixels, and an aspect ratio above 200 cut to 180. The processor (``AutoProcessor`` of the
model directory, its image processor; without torchvision, which Qwen's video processor needs,
``AutoImageProcessor``, which picks the PIL backend) then gives ``pixel_values`` [patches,
C·T·P·P] and ``image_grid_thw`` [images, 3]; an image stands for ``t·h·w // merge_size²`` image
tokens in the text.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .errors import DataError

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers.image_processing_utils import BaseImageProcessor

    from .templates import Message, VisionTokens

IMAGE_PLACEHOLDER = "<image>"
"""What marks an image's place in a turn (LLaMA-Factory's placeholder)."""
DEFAULT_MAX_PIXELS = 768 * 768
"""LLaMA-Factory's ``image_max_pixels`` default."""
DEFAULT_MIN_PIXELS = 32 * 32
"""LLaMA-Factory's ``image_min_pixels`` default."""
MIN_SIDE = 28
"""Qwen's vision tower needs at least one merged patch: sides below this are stretched to it."""
MAX_ASPECT = 200
"""Aspect ratios above this are refused by Qwen's processor: such an image is cut to
:data:`CUT_ASPECT` first, as LLaMA-Factory does."""
CUT_ASPECT = 180
UNSUPPORTED_MEDIA = ("videos", "audios")
"""LLaMA-Factory's media columns that are refused (videos need torchvision/av, audios a model)."""
MEDIA_REFUSED = ("videos and audios are not supported (images are: a vision-language template "
                 "such as qwen2_vl or qwen3_vl)")


@dataclass(frozen=True)
class ImageSettings:
    """How images are sized before the processor (``data.image_max_pixels`` / ``image_min_pixels``)."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    min_pixels: int = DEFAULT_MIN_PIXELS


def resolve_images(value: object, media_root: str, where: str) -> tuple[str, ...]:
    """The image paths of a record's ``images`` value (a path or a list of paths; None or []:
    none), each joined to ``media_root`` when that file exists (LLaMA-Factory's rule)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    paths = []
    for item in items:
        if not isinstance(item, str):
            raise DataError(f"{where}: 'images' must be image paths (a string or a list of strings), "
                            f"got {type(item).__name__}")
        joined = os.path.join(media_root, item) if media_root else item
        paths.append(joined if os.path.isfile(joined) else item)
    return tuple(paths)


def open_image(path: str, where: str) -> Image:
    """The image at ``path``, decoded; DataError (one line naming the sample) when it is
    missing or not an image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise DataError(f"{where}: image {path!r} does not exist (relative paths are looked up in "
                        "data.media_dir, else data.dataset_dir, then the working directory)")
    try:
        image = Image.open(path)
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"{where}: image {path!r} cannot be read ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else 'no detail'})") from None
    return image


def _scaled(image: Image, pixels: int) -> Image:
    factor = math.sqrt(pixels / (image.width * image.height))
    return image.resize((int(image.width * factor), int(image.height * factor)))


def regularize(image: Image, settings: ImageSettings) -> Image:
    """``image`` sized as LLaMA-Factory's Qwen plugins size it (see the module docstring)."""
    if image.width * image.height > settings.max_pixels:
        image = _scaled(image, settings.max_pixels)
    if image.width * image.height < settings.min_pixels:
        image = _scaled(image, settings.min_pixels)
    if image.mode != "RGB":
        image = image.convert("RGB")
    if min(image.width, image.height) < MIN_SIDE:
        image = image.resize((max(image.width, MIN_SIDE), max(image.height, MIN_SIDE)))
    if image.width / image.height > MAX_ASPECT:
        image = image.resize((image.height * CUT_ASPECT, image.height))
    if image.height / image.width > MAX_ASPECT:
        image = image.resize((image.width, image.width * CUT_ASPECT))
    return image


def load_image_processor(path: str | os.PathLike[str]) -> BaseImageProcessor:
    """The image processor of the model directory ``path`` (local files only): its
    ``AutoProcessor``'s, else (a processor whose video half needs torchvision) its
    ``AutoImageProcessor``. DataError (one line) when neither loads."""
    from transformers import AutoImageProcessor, AutoProcessor

    where = os.fspath(path)
    if not os.path.isdir(where):
        raise DataError(f"model.model_name_or_path={where!r} is not a local directory; a vision-language "
                        "template reads the model's processor (preprocessor_config.json) from it")
    try:
        processor = AutoProcessor.from_pretrained(where, local_files_only=True)
        image_processor = getattr(processor, "image_processor", None)
        if image_processor is not None:
            return image_processor
    except (ImportError, OSError, ValueError, TypeError, KeyError, AttributeError):
        pass  # e.g. Qwen's video processor without torchvision: the image processor alone will do
    try:
        return AutoImageProcessor.from_pretrained(where, local_files_only=True)
    except (ImportError, OSError, ValueError, TypeError, KeyError) as err:
        raise DataError(f"{where}: no image processor loads from this model directory "
                        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); valid: a "
                        "directory with the model's preprocessor_config.json") from None


def processor_digest(processor: BaseImageProcessor) -> dict[str, str]:
    """What of the image processor changes grids or pixels (for the tokenization cache key)."""
    described = processor.to_dict() if hasattr(processor, "to_dict") else vars(processor)
    return {"class": type(processor).__name__,
            **{key: repr(value) for key, value in sorted(described.items())}}


def merge_size(processor: BaseImageProcessor) -> int:
    """Patches merged per side into one image token (Qwen: 2)."""
    size = getattr(processor, "merge_size", None)
    if not isinstance(size, int) or size < 1:
        raise DataError(f"the image processor {type(processor).__name__} has no merge_size; valid: a "
                        "Qwen2-VL / Qwen2.5-VL / Qwen3-VL processor")
    return size


def image_inputs(processor: BaseImageProcessor, paths: Sequence[str], settings: ImageSettings,
                 where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values float32 [patches, C·T·P·P], image_grid_thw int64 [images, 3])`` of the
    images at ``paths``, in order (each image's patches after the previous image's)."""
    images = [regularize(open_image(path, where), settings) for path in paths]
    out = processor(images, return_tensors="pt")
    return (out["pixel_values"].numpy().astype(np.float32, copy=False),
            out["image_grid_thw"].numpy().astype(np.int64, copy=False))


def image_token_counts(grids: np.ndarray, merge: int) -> list[int]:
    """Image tokens each image of ``grids`` [images, 3] stands for: ``t·h·w // merge²``."""
    return [int(np.prod(grid)) // (merge * merge) for grid in grids]


def count_placeholders(messages: Sequence[Message]) -> int:
    """``<image>`` placeholders in the turns."""
    return sum(message["content"].count(IMAGE_PLACEHOLDER) for message in messages)


def expand_images(messages: Sequence[Message], counts: Sequence[int], tokens: VisionTokens) -> list[Message]:
    """The turns with the i-th ``<image>`` replaced by ``start + image * counts[i] + end``
    (the caller has checked there is one count per placeholder)."""
    pending = iter(counts)
    out = []
    for message in messages:
        pieces = message["content"].split(IMAGE_PLACEHOLDER)
        text = pieces[0]
        for piece in pieces[1:]:
            text += tokens.start + tokens.image * next(pending) + tokens.end + piece
        out.append({**message, "content": text})
    return out
