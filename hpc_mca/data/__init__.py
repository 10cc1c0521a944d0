"""Batch preparation: attention masks, position ids and packed-sequence metadata.

Submodules import torch; this package itself imports nothing so that ``import hpc_mca.data``
stays cheap.
"""
