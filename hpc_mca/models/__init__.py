"""Model building blocks on top of Megatron-Core.

This package imports nothing itself; ``hpc_mca.models.attention`` imports torch and
megatron.core when it is imported.
"""
