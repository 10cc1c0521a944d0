"""Step time of ``hpc-mca train`` against a bare Megatron-Core loop, side by side.

Both run in this process on the same tiny model (same HF weights), the same micro-batches and
the same optimizer settings (torch's fused AdamW in both, as ``training.fused_optimizer``
sets it; benchmarks/optimizer_step.py measures that kernel on its own). The bare loop has the shape of Megatron-Core's
run_simple_mcore_train_loop example: DDP, get_megatron_optimizer, forward_backward_func,
optimizer.step — no callbacks, metrics, data pipeline or skip checks. The two alternate for
``--rounds`` rounds so that load from other processes hits both alike; each side's best
(lowest) per-round median is compared (target ratio <= 1.05).

    .venv/bin/python benchmarks/train_overhead.py [--steps 30] [--layers 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trainer_fixtures import make_model_dir, make_sft_data, write_config  # noqa: E402


def trainer_step_times(config: Path, steps: int, run_dir: Path) -> list[float]:
    from hpc_mca.launch.run import run_training

    # A fresh run dir per round: an existing one would be resumed from its checkpoint.
    history = run_training(config, [f"training.max_steps={steps}", "training.logging_steps=1000",
                                    f"training.output_dir={run_dir}"])
    return [h.seconds for h in history]


def bare_step_times(config_path: Path, steps: int) -> list[float]:
    """The simple-train-loop shape on the trainer's own model builder and data."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hpc_mca.config.loading import load_config
    from hpc_mca.data.dataset import build_datasets, train_dataloader
    from hpc_mca.models.build import build_model
    from hpc_mca.runtime.distributed import init_distributed, shutdown
    from hpc_mca.topology import Layout
    from hpc_mca.trainer.step import make_forward_step

    config = load_config(config_path).resolve(1)
    ctx = init_distributed(Layout(), seed=config.training.seed)
    chunks = build_model(config.model.model_name_or_path, ctx, seq_length=config.data.cutoff_len,
                         load_weights=True, config_overrides={"calculate_per_token_loss": True})
    chunks[0].config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=False)
    model = [DistributedDataParallel(chunks[0].config, ddp, chunks[0])]
    tr = config.training
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=tr.learning_rate, min_lr=0.0,
                                                       clip_grad=tr.max_grad_norm), model)
    if tr.fused_optimizer:  # the same optimizer kernel as the trainer: the ratio is overhead only
        from hpc_mca.loop.optimizer import use_fused_adam

        use_fused_adam(optimizer)
    run = config.data_run()
    loader = iter(train_dataloader(build_datasets(config.data, run).train, run,
                                   data_parallel_rank=0))
    per_step = tr.gradient_accumulation_steps
    batches = [[next(loader) for _ in range(per_step)] for _ in range(steps)]  # prepared up front
    forward_backward, forward_step = get_forward_backward_func(), make_forward_step(ctx.device)
    times = []
    for micro in batches:
        start = time.perf_counter()
        model[0].zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=model,
                         num_microbatches=per_step, seq_length=micro[0].seq_length,
                         micro_batch_size=micro[0].rows, forward_only=False)
        optimizer.step()
        times.append(time.perf_counter() - start)
    shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_model_dir(root, layers=args.layers)
        config = write_config(root, model, make_sft_data(root, 2000, seed=1, name="train"),
                              training={"per_device_train_batch_size": 8, "global_batch_size": 32})
        skip = 3  # warm-up steps excluded from both
        bare, ours = [], []
        for round_ in range(args.rounds):
            bare.append(statistics.median(bare_step_times(config, args.steps)[skip:]))
            ours.append(statistics.median(trainer_step_times(config, args.steps, root / f"run{round_}")[skip:]))
    b, o = min(bare), min(ours)
    print(f"bare Megatron-Core loop : best median step {b * 1e3:8.2f} ms  (rounds: {_ms(bare)})")
    print(f"hpc-mca train           : best median step {o * 1e3:8.2f} ms  (rounds: {_ms(ours)})")
    print(f"ratio hpc-mca / bare    : {o / b:.3f}  (target <= 1.05)")


def _ms(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.1f}" for v in values)


if __name__ == "__main__":
    main()
