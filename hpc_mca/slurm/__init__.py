"""Slurm plumbing for the login-node commands: sbatch rendering, submission, queries, runs.

Pure Python on purpose (no torch, megatron or transformers): ``hpc-mca plan/submit/status/
logs/cancel/tensorboard`` import only this package, the topology planner and the trainer's
config module.

Modules:

* :mod:`.quoting` -- quoting for the shell and for ``#SBATCH`` directives.
* :mod:`.script` -- the batch script: one renderer (a pure function) behind both
  ``sbatch/train.sbatch`` (its output for the defaults) and what ``hpc-mca submit`` submits.
* :mod:`.jobplan` -- from a run config + CLI options to a plan and the trainer overrides.
* :mod:`.commands` -- running sbatch/squeue/sacct/scontrol/scancel; the job-state join.
* :mod:`.manifest` -- the run manifest written at submit, and finding a run by job id.
* :mod:`.index` -- the user's job index (job id -> run dir), so commands work from anywhere.
* :mod:`.continuation` -- ``hpc-mca resume``: a run continued in a new job (checked first).
* :mod:`.progress` -- the progress file the trainer writes (format and tolerant reader).
* :mod:`.timelimit` -- Slurm time limits and the lead-time signal that must fit in one.
* :mod:`.watchdog`, :mod:`.preflight`, :mod:`.exclusion` -- on the batch node: a hung job
  stopped, nodes checked before training, and the nodes a requeued job keeps away from.
* :mod:`.submit`, :mod:`.status`, :mod:`.logs`, :mod:`.cancel`, :mod:`.tensorboard` -- what
  the commands do.
"""

from .errors import OpsError

__all__ = ["OpsError"]
