"""The Megatron backend (``training.use_mca: true``): objectives per stage, the training step
over Megatron's pipeline schedules and the loop that drives it (:mod:`.trainer`).

Its config is :mod:`hpc_mca.config`; the step-end pieces it shares with the standard backend
(boundary decisions, metrics, trackers, callbacks) are :mod:`hpc_mca.loop`.
"""
