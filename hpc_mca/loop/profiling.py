"""``training.profile_steps``: torch.profiler over a window of optimizer steps, on rank 0.

A transformers ``TrainerCallback``, so both backends run it the same way: the profiler starts
before step ``first`` and stops after step ``last`` (or when the run stops inside the window),
then rank 0 writes into ``output_dir/profile/``:

* ``steps-<first>-<last>.json.gz``: the Chrome/Perfetto trace (CPU ops, and CUDA kernels on a
  GPU), for https://ui.perfetto.dev or chrome://tracing;
* ``steps-<first>-<last>.txt``: torch's operator table over the window, sorted by self device
  time (self CPU time on CPU), the table that says where a step's time goes.

The profiled steps run slower than the others (the profiler records every op), and writing
the trace lands in the time of the step after the window (Megatron backend: callbacks run
after a step's clock stops) or of its last step (standard backend): their ``seconds`` in
steps.jsonl and the tokens/s of their logging window show it, so the run log names the
window. Other ranks run unprofiled.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState

if TYPE_CHECKING:
    from transformers import TrainingArguments

__all__ = ["ProfilerCallback", "activities", "operator_table"]

_TABLE_ROWS = 30


class ProfilerCallback(TrainerCallback):
    """Profiles optimizer steps ``first``..``last`` (1-based, inclusive) on rank 0."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.profiler: torch.profiler.profile | None = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: object) -> TrainerControl:
        if state.is_world_process_zero and state.global_step + 1 == self.first:
            print(f"profiling steps {self.first}-{self.last}: their step times and the next "
                  "step's (or the window's last, by backend) include the profiler's overhead "
                  "and the trace export", flush=True)
            self.profiler = torch.profiler.profile(activities=activities(torch.cuda.is_available()))
            self.profiler.start()
        return control

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object) -> TrainerControl:
        if self.profiler is not None and state.global_step >= self.last:
            self._finish(_output_dir(args), state.global_step)
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object) -> TrainerControl:
        if self.profiler is not None:  # stopped (signal, max_steps) inside the window
            self._finish(_output_dir(args), state.global_step)
        return control

    def _finish(self, output_dir: Path, step: int) -> None:
        profiler, self.profiler = self.profiler, None
        assert profiler is not None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()  # the window's kernels end inside the window
        profiler.stop()
        out = output_dir / "profile"
        out.mkdir(parents=True, exist_ok=True)
        stem = f"steps-{self.first}-{step}"
        profiler.export_chrome_trace(str(out / f"{stem}.json.gz"))
        (out / f"{stem}.txt").write_text(operator_table(profiler, cuda) + "\n")
        print(f"profile of steps {self.first}-{step}: {out / stem}.json.gz (trace), "
              f"{out / stem}.txt (operators by self {'device' if cuda else 'CPU'} time)",
              flush=True)


def _output_dir(args: TrainingArguments) -> Path:
    out = args.output_dir
    # transformers fills an unset one in when its arguments are made; the run config's is a str.
    assert out is not None
    return Path(out)


def activities(cuda: bool) -> list[torch.profiler.ProfilerActivity]:
    """What to record: host ops, and the device's kernels when ``cuda``."""
    out = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        out.append(torch.profiler.ProfilerActivity.CUDA)
    return out


def operator_table(profiler: torch.profiler.profile, cuda: bool) -> str:
    """torch's operator table, by self device time with ``cuda`` (else self CPU time)."""
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=sort, row_limit=_TABLE_ROWS)
