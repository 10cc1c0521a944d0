"""The exception raised for Hugging Face models and checkpoints hpc-mca cannot use as given."""

from __future__ import annotations

from hpc_mca.errors import UserError


class ModelLoadError(UserError):
    """An unsupported model or option, or a checkpoint that does not match its config.

    The message is one line naming the file and, where one is involved, the tensor, so a
    launcher can print the same line from every rank. Raised by cheap pre-checks (config.json
    and safetensors headers) before any rank allocates the model.
    """
