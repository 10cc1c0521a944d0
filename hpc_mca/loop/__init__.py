"""What both backends' loops share: the step-boundary decision (save, stop, requeue), the
metrics and trackers a run writes, callbacks and the profiler, the fused-optimizer choice.

Above the checkpointer and below both backends (:mod:`hpc_mca.trainer`,
:mod:`hpc_mca.standard`), so neither backend imports the other.
"""
