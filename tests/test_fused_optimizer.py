"""torch's fused AdamW switched on under a Megatron-style optimizer wrapper."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hpc_mca.loop.optimizer import use_fused_adam


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator))
            for shape in ((7, 5), (5,), (3, 3, 2))]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()


def test_fused_adamw_steps_like_the_loop_and_reports_what_it_switched():
    loop_params, fused_params = _params(), _params()
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1)
    inner = torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.1)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner),
                                                  SimpleNamespace(optimizer=torch.optim.SGD(
                                                      _params(), lr=0.1))])
    assert use_fused_adam(chained) == 1  # Adam switched, SGD left alone
    assert all(group["fused"] for group in inner.param_groups)
    _train(loop, loop_params)
    _train(inner, fused_params)
    for a, b, start in zip(loop_params, fused_params, _params()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
        assert not torch.equal(a, start)  # the weights did move


def test_step_counters_are_put_where_the_fused_kernel_wants_them():
    """A loaded checkpoint may hand back a float64 or shared-storage step; the pre-step hook
    gives the kernel float32 counters on the parameter's device and training continues."""
    params = _params()
    inner = torch.optim.AdamW(params, lr=1e-2)
    use_fused_adam(SimpleNamespace(optimizer=inner))
    _train(inner, params)
    for p in params:
        inner.state[p]["step"] = inner.state[p]["step"].double()
    _train(inner, params)
    assert all(inner.state[p]["step"].dtype == torch.float32 for p in params)
    assert all(float(inner.state[p]["step"]) == 8 for p in params)


def test_a_bare_torch_adamw_is_switched_too():
    """The standard backend hands its torch AdamW over unwrapped; it steps like the loop."""
    loop_params, fused_params = _params(), _params()
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1)
    bare = torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.1)
    assert use_fused_adam(bare) == 1
    assert all(group["fused"] and not group["foreach"] for group in bare.param_groups)
    _train(loop, loop_params)
    _train(bare, fused_params)
    for a, b in zip(loop_params, fused_params):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
