"""Where tokenized datasets and converted records are cached by default (a module of its own:
the store, the record readers and the blended corpora all read it)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$HPC_MCA_CACHE_DIR/tokenized``, by default ``~/.cache/hpc_mca/tokenized``
    (``data.preprocessing_cache_dir`` names another)."""
    root = os.environ.get("HPC_MCA_CACHE_DIR") or Path.home() / ".cache" / "hpc_mca"
    return Path(root) / "tokenized"
