"""Multimodal rotary positions (Qwen2-VL's M-RoPE) of one sample, images only.

Each token gets three positions (temporal, height, width). Text tokens get the same value in
all three, one more than the token before. The tokens of one image, a grid of ``t × h × w``
merged patches (``grid_thw`` divided by the spatial merge size on h and w) laid out row by row,
all start from the position ``p`` the next text token would have had: temporal ``p + frame``,
height ``p + row``, width ``p + column``. The text after the image continues from
``p + max(h, w)`` (an image's frame count is 1). This is what transformers'
``get_rope_index`` of Qwen2-VL, Qwen2.5-VL and Qwen3-VL computes for images (tested against
it in tests/test_vl_data.py); a text-only sample's positions are ``0..n-1`` three times.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError


def rope_index(input_ids: np.ndarray, grids: np.ndarray, image_token_id: int, merge: int) -> np.ndarray:
    """int64 [3, n]: the M-RoPE positions of one sample's ``input_ids`` [n], whose runs of
    ``image_token_id`` are its images in the order of ``grids`` [images, 3]."""
    ids = np.asarray(input_ids)
    n = len(ids)
    out = np.empty((3, n), dtype=np.int64)
    is_image = ids == image_token_id
    # Runs of image tokens: where a run starts and ends.
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != len(grids):
        raise DataError(f"a sample has {len(starts)} runs of image tokens but {len(grids)} image grids")
    at, position = 0, 0
    for start, end, grid in zip(starts, ends, grids):
        text = int(start) - at
        out[:, at:start] = position + np.arange(text)
        position += text
        t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
        if t * h * w != end - start:
            raise DataError(f"an image of grid {tuple(int(g) for g in grid)} needs {t * h * w} image "
                            f"tokens; the sample has {int(end - start)} there")
        frames, rows, cols = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[0, start:end] = position + frames.reshape(-1)
        out[1, start:end] = position + rows.reshape(-1)
        out[2, start:end] = position + cols.reshape(-1)
        position += max(h, w)
        at = int(end)
    out[:, at:] = position + np.arange(n - at)
    return out
