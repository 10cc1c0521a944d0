"""A GPU rank makes its pinned host memory by registering it from 8 threads: the setting is
added to the allocator configuration torch reads, after what the user set, unless the user
already chose how pinned memory is made (hpc_mca.runtime.host_memory)."""

from __future__ import annotations

import pytest

from hpc_mca.runtime.host_memory import SETTING, register_pinned_host_memory

CASES = [  # (environment before, the variable set, its value after)
    ({}, "PYTORCH_CUDA_ALLOC_CONF", SETTING),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "PYTORCH_CUDA_ALLOC_CONF",
     f"expandable_segments:True,{SETTING}"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True,"}, "PYTORCH_ALLOC_CONF",
     f"expandable_segments:True,{SETTING}"),
    # both set: CUDA's allocator reads PYTORCH_CUDA_ALLOC_CONF
    ({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}, "PYTORCH_CUDA_ALLOC_CONF",
     f"b:2,{SETTING}"),
]


@pytest.mark.parametrize("before, name, after", CASES)
def test_the_setting_joins_the_configuration_torch_reads(before, name, after):
    environ = dict(before)
    assert register_pinned_host_memory(environ) == name
    assert environ[name] == after
    assert {k: v for k, v in environ.items() if k != name} == \
        {k: v for k, v in before.items() if k != name}


def test_a_users_own_pinned_choice_is_kept():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
    assert register_pinned_host_memory(environ) is None
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}

