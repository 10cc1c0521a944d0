"""The requeue protocol: how a Slurm job saves before its time runs out and comes back.

This docstring is the contract between the batch script (``sbatch/train.sbatch``, rendered by
``hpc_mca/slurm/script.py``) and the ranks. Files live in the run directory ($HPC_MCA_RUN_DIR).

1. Submission: ``--requeue`` and ``--signal=B:USR1@<lead>``: Slurm sends USR1 to the batch
   shell ``lead`` seconds (Slurm checks every 30 s: up to ~60 s more) before the time limit;
   with a limit under lead + 30 s that can be the moment the job starts, so the shell holds a
   USR1 that comes before its handler exists and handles it once it does.
   Only the batch shell gets it, and torchrun would not forward it anyway.
2. Batch shell, on USR1 or TERM: appends ``<SIG> <unix time> job=<id> restart=<n>`` to
   ``signal_received`` ($HPC_MCA_SIGNAL_FILE, removed when the job (re)starts), for a TERM
   followed by ``cause=<verdict>`` (Slurm's reason, below), for a USR1 with ``left=<s>``
   after the time (seconds to the time limit, squeue's EndTime; empty when Slurm does not
   say), and keeps waiting for srun. (With
   HPC_MCA_FORWARD_SIGNAL=USR1 it also signals the tasks; only for srun-launched ranks: a
   USR1 before a rank's handler is installed would kill it.)
3. Ranks: at every step boundary, global rank 0 looks for ``signal_received`` (one stat per
   step, one rank: no metadata storm on a parallel file system); every rank also notes USR1
   or TERM delivered to itself (srun forwards TERM at a time limit, preemption or scancel).
   One all-reduce (MAX) of that flag makes every rank agree at the same step. Then all ranks
   save together (the checkpoint commit: see :mod:`hpc_mca.checkpoint.store`), stop, and
   exit 0 without writing ``finished``. A second TERM to a rank kills it at once. The ranks
   do not decide whether the job comes back; the batch shell does.
4. Batch shell, after srun returned (exit code rc), asks Slurm why the job is ending
   (``squeue -O State,Reason,RestartCnt`` for its own id) — the verdict:

   * ``requeued``: RestartCnt is above SLURM_RESTART_COUNT, so an outside ``scontrol
     requeue`` (or a preemption with PreemptMode=REQUEUE) already put the job back;
   * ``timelimit`` (Reason=TimeLimit) or ``preempted``;
   * ``cancelled``: the job is ending for any other reason (``scancel``; ``hpc-mca cancel``
     also writes ``job=<id> ...`` to ``cancel_requested`` first, which counts the same);
   * ``running``: nothing is ending the job (the ranks ended, or a TERM came from
     ``scancel --signal=TERM`` alone); ``unknown``: squeue did not answer.

   Then, first match wins:

   * ``finished`` exists (written by rank 0 after the last step's checkpoint): done; exit rc.
     A completed run is never requeued, whatever signals came late.
   * ``bad_input`` exists (removed at each start; a rank writes the one-line reason before it
     exits 2: config, data, layout, model files, a checkpoint that does not fit the disk):
     never requeued, exit 2, the reason in the end banner — whatever srun made of the exit
     codes when it killed the other ranks (143, 1).
   * the run directory's file system has no byte left (even that record could not be
     written): never requeued.
   * ``cancelled``: never requeued, whatever signals came before (a lead-time USR1 included).
   * ``requeued``: nothing to do; Slurm restarts the job. Exit 0: this start did not fail
     (an exit 75 here left accounting a FAILED batch step for every outside requeue).
   * ``timelimit`` or ``preempted``, or a USR1 was recorded: ``scontrol requeue
     $SLURM_JOB_ID`` (same job id; Slurm bumps SLURM_RESTART_COUNT; the job restarts after
     the requeue hold) if SLURM_RESTART_COUNT < HPC_MCA_MAX_REQUEUES, else exit 75
     ("stopped, not finished"). A ``cancel_requested`` record that appears while the requeue
     is being made still wins: the shell cancels the requeued job.
   * only a TERM was recorded (``scancel --signal=TERM``): no requeue; exit 75 if the ranks
     stopped early.

   Every requeue the shell makes, or sees Slurm make, is appended with its reason to
   ``requeues`` in the run directory (``hpc-mca status`` and ``watch`` show it while the job
   is pending). The requeue line names the reason: a USR1 is the lead-time signal when it
   came at most lead + 60 s before the limit (the lead from the script's ``#SBATCH
   --signal`` line; Slurm checks every 30 s), else one sent by hand (``scancel
   --signal=USR1``); ranks that exited non-zero are named first, from srun's own line on
   the first failed task (``task 1 on n2 failed: killed by SIGKILL (srun exit code 143)``:
   srun's exit code alone can say 143 for a SIGKILLed rank), else by srun's exit code and
   its signal (``137 (SIGKILL)``).
   * rc != 0 and rc != 2 (2 = bad input; retrying cannot help) and
     HPC_MCA_REQUEUE_ON_FAILURE=1: requeue within the same budget, so a crash on a flaky node
     resumes from the last checkpoint while a job that keeps failing stops after
     HPC_MCA_MAX_REQUEUES restarts. (A SIGKILLed rank leaves nothing behind to delay this:
     the checkpoint writer's helper processes die with it, :mod:`.helper`.)
5. Restart: the same command runs again; ``training.resume_from_checkpoint=auto`` (the default)
   continues from ``checkpoints/latest``: same samples, LR curve and steps.jsonl (lines after
   the checkpoint's step are dropped, then appended to).

:class:`StopSignal` is the rank side of steps 2-3: it notes the signals and makes the ranks
agree; the trainer's step boundary (:mod:`hpc_mca.loop.boundary`) turns an agreed stop into
a save and the end of the loop.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hpc_mca.rundir import SIGNAL_FILE

if TYPE_CHECKING:  # torch is imported where a collective needs it
    import torch

SIGNAL_FILE_ENV = "HPC_MCA_SIGNAL_FILE"
_CODES = {"USR1": 1, "TERM": 2}
"""Stop reasons, ordered: a TERM outranks a USR1 in the agreed code (both mean: save, stop)."""


class StopSignal:
    """USR1/TERM to the batch shell (its signal file) or to this rank, agreed by all ranks.

    Installs its handlers when made (``listen``), else at :meth:`listen`; :meth:`restore`
    gives the defaults back. :meth:`agree` is a collective that every rank calls at every
    step boundary.
    """

    def __init__(self, run_dir: Path, device: torch.device, is_main: bool, *, listen: bool = True) -> None:
        self.signal_file = Path(os.environ.get(SIGNAL_FILE_ENV) or Path(run_dir) / SIGNAL_FILE)
        self.device, self.is_main = device, is_main
        self.received = 0
        self.received_at: float | None = None
        """When the stop was requested: the batch shell's record of the signal (rank 0 reads
        it), else when this rank got a signal; for the signal-to-durable line."""
        if listen:
            self.listen()

    @staticmethod
    def describe(code: int) -> str:
        # A USR1 is Slurm's lead-time signal or one sent by hand: the batch shell's requeue
        # line says which (it asks Slurm how far the limit is).
        return {1: "USR1", 2: "TERM"}.get(code, "")

    def listen(self) -> None:
        """From now until :meth:`restore`, a USR1/TERM to this rank is a stop request."""
        for name in _CODES:
            signal.signal(getattr(signal, f"SIG{name}"), self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name.removeprefix("SIG")
        self.received = max(self.received, _CODES[name])
        self.received_at = self.received_at or time.time()
        if name == "TERM":
            # The next TERM (e.g. Slurm's kill after KillWait, torchrun's) ends the process.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def local_code(self) -> int:
        """This rank's stop code: its own signals, and on rank 0 the batch shell's record."""
        code = self.received
        if self.is_main:
            recorded, when = read_signal_file(self.signal_file)
            if recorded:
                code = max(code, recorded)
                self.received_at = min(when or time.time(), self.received_at or time.time())
        return code

    def agree(self) -> int:
        """The highest stop code of any rank (0 = keep training): one all-reduce, so every
        rank sees the same answer at the same step."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.local_code()], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        """Give SIGUSR1/SIGTERM their default handling back (after training)."""
        for name in _CODES:
            signal.signal(getattr(signal, f"SIG{name}"), signal.SIG_DFL)


def read_signal_file(path: Path) -> tuple[int, float | None]:
    """The highest stop code recorded in the batch shell's signal file (0 if none) and the
    time of the first record (lines: ``<SIG> <unix time> ...``)."""
    try:
        text = path.read_text()
    except OSError:
        return 0, None
    code, first = 0, None
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        code = max(code, _CODES.get(words[0].removeprefix("SIG"), 0))
        if first is None and len(words) > 1 and words[1].replace(".", "", 1).isdigit():
            first = float(words[1])
    return code, first
