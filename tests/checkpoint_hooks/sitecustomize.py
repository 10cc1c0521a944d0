"""Test-only fault and pacing hooks for checkpoint/requeue tests, loaded by putting this
directory on PYTHONPATH (Python imports ``sitecustomize`` at start-up). Inactive unless one
of these variables is set; it never changes numerics.

HPC_MCA_TEST_STEP_SLEEP=S[@R]  sleep S seconds after every optimizer step (either backend), only while
                               SLURM_RESTART_COUNT is R (default: always) — so a job lasts
                               until Slurm's signal arrives, then finishes fast after a requeue.
HPC_MCA_TEST_SAVE_SLEEP=S@STEP  every rank prints "test hook: rank R saving step STEP" and
                               sleeps S seconds inside the save of step STEP, after its
                               iter_STEP.tmp directory exists and before any shard is written
                               (a window in which to cancel or kill the job mid-save).
HPC_MCA_TEST_KILL=STEP:POINT:RANK[@R]  SIGKILL global rank RANK during the save of step STEP,
                               at POINT: before_write (the shards of this rank not yet
                               written), after_write (written, not committed) or
                               before_tracker (rank 0: checkpoint renamed into place, tracker
                               not yet replaced); only while SLURM_RESTART_COUNT is R when
                               given (a requeued job then gets past that save).
HPC_MCA_TEST_BLOCK=STEP:RANK[@R]  global rank RANK, at the end of step STEP (before the loop
                               marks the step done), enters a barrier of a process group that
                               no other rank ever enters: it blocks inside a collective while
                               its heartbeat thread lives (the watchdog's "behind" case).
HPC_MCA_TEST_RANK_SLEEP=S:RANK  global rank RANK sleeps S seconds at the end of every step: a
                               slow rank that still makes progress.
HPC_MCA_TEST_FREEZE=POINT:RANK[@R]  global rank RANK stops itself (SIGSTOP: its heartbeat
                               thread too) at POINT: process_group (its process group just
                               made), data (data preparation begins), load (the checkpoint
                               load begins) or save (the first save of the process begins);
                               only while SLURM_RESTART_COUNT is R when given.
HPC_MCA_TEST_PREFLIGHT_FAIL=NODEID@R  the preflight's matmul on the node with SLURM_NODEID
                               NODEID comes back with one entry off by 1, only while
                               SLURM_RESTART_COUNT is R: that node fails its node check.
HPC_MCA_TEST_PREFLIGHT_FREEZE=NODEID@R[:reduce]  the preflight process of the node with
                               SLURM_NODEID NODEID stops itself (SIGSTOP) as it reaches the
                               all-reduce, before joining it (with :reduce: after joining, as
                               it enters the all-reduce itself), only while SLURM_RESTART_COUNT
                               is R: a node hung in its preflight.
HPC_MCA_TEST_PREFLIGHT_RENDEZVOUS=S  the preflight's nodes wait S seconds for each other at the
                               all-reduce (instead of 60): a fast test of an absent node.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

_PATCHES = {}


def _patch_after_import(module_name, patch):
    earlier = _PATCHES.get(module_name)
    if earlier is None:
        _PATCHES[module_name] = patch
        return

    def both(module):  # several hooks may patch one module
        earlier(module)
        patch(module)

    _PATCHES[module_name] = both


class _Finder(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module finished executing."""

    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _PATCHES.pop(name)(module)

        loader.exec_module = exec_module
        return spec


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _kill_self(where: str) -> None:
    print(f"test hook: SIGKILL rank {_rank()} {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _saving_step(checkpointer) -> int:
    """The step a Checkpointer.save call is about to save (the run's counters, as saved)."""
    return checkpointer.loop.counters.state_dict()["global_step"]


def _install_sleep(spec: str) -> None:
    seconds, _, restart = spec.partition("@")
    if restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart:
        return

    def patch(module):
        original = module.Trainer.train_step

        def train_step(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            time.sleep(float(seconds))
            return result

        module.Trainer.train_step = train_step

    def patch_standard(module):  # the standard backend's step end, after the optimizer step
        original = module.StandardTrainer.end_step

        def step_end(self, *args, **kwargs):
            time.sleep(float(seconds))
            return original(self, *args, **kwargs)

        module.StandardTrainer.end_step = step_end

    _patch_after_import("hpc_mca.trainer.trainer", patch)
    _patch_after_import("hpc_mca.standard.trainer", patch_standard)


def _install_kill(spec: str) -> None:
    spec, _, restart = spec.partition("@")
    step, point, rank = spec.split(":")
    if _rank() != int(rank) or restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart:
        return
    step = int(step)

    def patch(module):
        if point == "before_tracker":
            original_tracker = module.write_tracker

            def write_tracker(root, name):
                if name.endswith(f"{step:07d}"):
                    _kill_self(f"before the tracker names {name}")
                return original_tracker(root, name)

            module.write_tracker = write_tracker
            return
        original_save = module.Checkpointer.save

        def save(self, *args, **kwargs):
            if _saving_step(self) != step:
                return original_save(self, *args, **kwargs)
            from megatron.core import dist_checkpointing

            real = dist_checkpointing.save

            def killing_save(*args, **kwargs):
                if point == "before_write":
                    _kill_self(f"before writing its shards of step {step}")
                out = real(*args, **kwargs)
                _kill_self(f"after writing its shards of step {step}, before the commit")
                return out

            dist_checkpointing.save = killing_save
            return original_save(self, *args, **kwargs)

        module.Checkpointer.save = save

    # The tracker is moved by the commit protocol both checkpoint formats share.
    where = "commit" if point == "before_tracker" else "checkpointer"
    _patch_after_import(f"hpc_mca.checkpoint.{where}", patch)


def _install_save_sleep(spec: str) -> None:
    seconds, _, step = spec.partition("@")

    def patch(module):
        original_save = module.Checkpointer.save

        def save(self, *args, **kwargs):
            if _saving_step(self) != int(step):
                return original_save(self, *args, **kwargs)
            from megatron.core import dist_checkpointing

            real = dist_checkpointing.save

            def slow_save(*args, **kwargs):
                print(f"test hook: rank {_rank()} saving step {step}", flush=True)
                time.sleep(float(seconds))
                return real(*args, **kwargs)

            dist_checkpointing.save = slow_save
            try:
                return original_save(self, *args, **kwargs)
            finally:
                dist_checkpointing.save = real

        module.Checkpointer.save = save

    _patch_after_import("hpc_mca.checkpoint.checkpointer", patch)


def _install_block(spec: str) -> None:
    spec, _, restart = spec.partition("@")
    step, rank = (int(v) for v in spec.split(":"))
    if restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart:
        return

    def patch(module):
        import torch.distributed as dist

        original_begin, original_end = module.RunLoop.begin, module.RunLoop.end_step

        def begin(self, *args, **kwargs):
            self._test_block_group = dist.new_group(backend="gloo")  # a collective: every rank
            return original_begin(self, *args, **kwargs)

        def end_step(self, result):
            if _rank() == rank and self.backend.state.global_step == step:
                print(f"test hook: rank {rank} blocks in a barrier at step {step}", flush=True)
                dist.barrier(group=self._test_block_group)
            return original_end(self, result)

        module.RunLoop.begin, module.RunLoop.end_step = begin, end_step

    _patch_after_import("hpc_mca.loop.driver", patch)


def _install_rank_sleep(spec: str) -> None:
    seconds, rank = spec.split(":")
    if _rank() != int(rank):
        return

    def patch(module):
        original = module.RunLoop.end_step

        def end_step(self, result):
            time.sleep(float(seconds))
            return original(self, result)

        module.RunLoop.end_step = end_step

    _patch_after_import("hpc_mca.loop.driver", patch)


def _install_preflight_fail(spec: str) -> None:
    node, _, restart = spec.partition("@")
    if os.environ.get("SLURM_NODEID") != node or os.environ.get("SLURM_RESTART_COUNT", "0") != restart:
        return

    def patch(module):
        original = module._product

        def wrong_product(a, b, device):
            out = original(a, b, device)
            out[0, 0] += 1.0  # one entry, as a faulty device would return it
            return out

        module._product = wrong_product

    _patch_after_import("hpc_mca.runtime.node_check", patch)


_FREEZE_POINTS = {
    # point: (module, attribute path, freeze before (True) or after the call)
    "process_group": ("hpc_mca.runtime.distributed", ("init_distributed",), False),
    "data": ("hpc_mca.data.dataset", ("build_datasets",), True),
    "load": ("hpc_mca.checkpoint.checkpointer", ("Checkpointer", "resume"), True),
    "save": ("hpc_mca.checkpoint.checkpointer", ("Checkpointer", "save"), True),
}


def _install_freeze(spec: str) -> None:
    spec, _, restart = spec.partition("@")
    point, rank = spec.split(":")
    if _rank() != int(rank) or (restart and os.environ.get("SLURM_RESTART_COUNT", "0") != restart):
        return
    module_name, path, before = _FREEZE_POINTS[point]

    def freeze():
        print(f"test hook: rank {rank} freezes at {point}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, its heartbeat's too

    def patch(module):
        owner = module
        for name in path[:-1]:
            owner = getattr(owner, name)
        original = getattr(owner, path[-1])

        def frozen(*args, **kwargs):
            if before:
                freeze()
            out = original(*args, **kwargs)
            if not before:
                freeze()
            return out

        setattr(owner, path[-1], frozen)

    _patch_after_import(module_name, patch)


def _install_preflight_freeze(spec: str) -> None:
    spec, _, restart = spec.partition("@")
    restart, _, where = restart.partition(":")
    if os.environ.get("SLURM_NODEID") != spec or os.environ.get("SLURM_RESTART_COUNT", "0") != restart:
        return

    def stop(what: str) -> None:
        print(f"test hook: node {spec} ({os.environ.get('SLURMD_NODENAME', '?')}, pid {os.getpid()}) "
              f"stops (SIGSTOP) {what}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    def patch(module):
        if where == "reduce":
            import torch.distributed as dist

            real = dist.all_reduce

            def all_reduce(*args, **kwargs):
                stop("in the all-reduce, after joining it")
                return real(*args, **kwargs)

            dist.all_reduce = all_reduce
            return
        original = module.all_reduce

        def all_reduce(*args, **kwargs):
            stop("before joining the all-reduce")
            return original(*args, **kwargs)

        module.all_reduce = all_reduce

    _patch_after_import("hpc_mca.runtime.node_check", patch)


def _install_preflight_rendezvous(spec: str) -> None:
    def patch(module):
        original = module.run

        def run(env=None, **kwargs):
            kwargs.setdefault("rendezvous_timeout_s", float(spec))
            return original(env, **kwargs)

        module.run = run

    _patch_after_import("hpc_mca.runtime.node_check", patch)


_HOOKS = {"HPC_MCA_TEST_FREEZE": _install_freeze,
          "HPC_MCA_TEST_STEP_SLEEP": _install_sleep, "HPC_MCA_TEST_KILL": _install_kill,
          "HPC_MCA_TEST_SAVE_SLEEP": _install_save_sleep, "HPC_MCA_TEST_BLOCK": _install_block,
          "HPC_MCA_TEST_RANK_SLEEP": _install_rank_sleep,
          "HPC_MCA_TEST_PREFLIGHT_FAIL": _install_preflight_fail,
          "HPC_MCA_TEST_PREFLIGHT_FREEZE": _install_preflight_freeze,
          "HPC_MCA_TEST_PREFLIGHT_RENDEZVOUS": _install_preflight_rendezvous}
for _name, _install in _HOOKS.items():
    if os.environ.get(_name):
        _install(os.environ[_name])
if _PATCHES:
    sys.meta_path.insert(0, _Finder())
