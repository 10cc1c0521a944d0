"""The data settings' valid values, light enough for the config rules a login node's ``plan``
and ``submit`` run (data.mix and data.tokenize, which use them, load numpy)."""

MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
"""data.mix_strategy, as in LLaMA-Factory (see hpc_mca.data.mix)."""
PT_CHUNKINGS = ("concat", "document")
"""data.pt_chunking (see hpc_mca.data.tokenize.pt_samples)."""
