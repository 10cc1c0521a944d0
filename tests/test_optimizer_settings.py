"""Each optimizer setting changes the updates: a run with it differs from the run without it
from step 2 on (step 1's loss comes before any update and is equal). That the values are
applied as torch's AdamW applies them is tests/test_standard.py's parity of the two backends
(the standard backend hands them to torch.optim.AdamW) with non-default betas, epsilon and
clipping."""

from __future__ import annotations

import pytest
from trainer_fixtures import make_model_dir, make_sft_data, run_train, steps, write_config

pytestmark = pytest.mark.slow

CHANGED = {
    "training.adam_beta1": "0.5",
    "training.adam_beta2": "0.9",
    "training.adam_epsilon": "0.01",  # of the order of the second moments' roots here
    "training.max_grad_norm": "0",  # no clipping: the base run clips (grad norms ~2.7 > 1)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("optimizer_settings")
    model = make_model_dir(root, layers=1)
    config = write_config(root, model, make_sft_data(root, 48, seed=2, name="train"), training={
        "max_steps": 3, "logging_steps": 1, "lr_scheduler_type": "constant", "warmup_steps": 0,
        "report_to": ["none"]})
    done = {}
    for name, overrides in {"base": [], **{k: [f"{k}={v}"] for k, v in CHANGED.items()}}.items():
        proc = run_train(config, root / name.replace(".", "_"), 1, *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        done[name] = steps(root / name.replace(".", "_"))
    return done


@pytest.mark.parametrize("setting", sorted(CHANGED))
def test_a_changed_optimizer_setting_changes_the_updates(runs, setting):
    base, changed = runs["base"], runs[setting]
    assert changed[0]["loss"] == base[0]["loss"]  # before the first update
    if setting == "training.max_grad_norm":
        assert base[0]["grad_norm"] > 1.0  # so the base run's first update was clipped
    assert abs(changed[2]["loss"] - base[2]["loss"]) > 1e-4, (changed, base)
