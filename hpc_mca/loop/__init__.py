"""What both backends' loops share: the run-loop driver that owns the step end (:mod:`.driver`),
the run's counters a checkpoint saves as one unit (:mod:`.counters`), the step-boundary
decision (save, stop, requeue), the metrics and trackers a run writes,
callbacks and the profiler, the fused-optimizer choice, the preference loss and the
exact-match eval metric.

Above the checkpointer and below both backends (:mod:`hpc_mca.trainer`,
:mod:`hpc_mca.standard`), so neither backend imports the other.
"""
