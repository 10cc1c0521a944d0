"""bin/hpc-mca-rank, the per-task launcher: interpreter choice, environment, container
wrappers (with stand-ins for apptainer and enroot that record their command line), quoting."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "bin" / "hpc-mca-rank"
HOSTILE = "it's \"x\"; $(touch pwned) `id` *"

RECORDER = """#!/bin/bash
# Stand-in: record argv (NUL-separated) and a few variables, then succeed.
printf '%s\\0' "$@" >"${RECORD_DIR}/$(basename "$0").args"
printf 'PYTHONPATH=%s\\nOMP_NUM_THREADS=%s\\nVIRTUAL_ENV=%s\\nHPC_MCA_HOME=%s\\n' \
    "${PYTHONPATH:-}" "${OMP_NUM_THREADS:-}" "${VIRTUAL_ENV:-}" "${HPC_MCA_HOME:-}" \
    >"${RECORD_DIR}/$(basename "$0").env"
"""


def _tools(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "tools dir"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text(RECORDER)
        (folder / name).chmod(0o755)
    return folder


def _env(tmp_path: Path, tools: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPC_MCA_", "SLURM_", "VIRTUAL_ENV", "PYTHONPATH", "OMP_"))}
    env.update(PATH=f"{tools}:{env['PATH']}", RECORD_DIR=str(tmp_path), **extra)
    return env


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAUNCHER), *args], env=env, capture_output=True, text=True,
                          timeout=30, cwd=env["RECORD_DIR"])


def _args(tmp_path: Path, name: str) -> list[str]:
    return (tmp_path / f"{name}.args").read_text().split("\0")[:-1]


def _recorded_env(tmp_path: Path, name: str) -> dict[str, str]:
    lines = (tmp_path / f"{name}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_venv_python_runs_the_rank_with_arguments_intact(tmp_path: Path) -> None:
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(RECORDER)
    (venv / "bin" / "python").chmod(0o755)
    env = _env(tmp_path, _tools(tmp_path), HPC_MCA_VENV=str(venv), SLURM_CPUS_PER_TASK="6")
    done = _run(env, "train", f"/cfg/{HOSTILE}.yaml", f"text_field={HOSTILE}", "")
    assert done.returncode == 0, done.stderr
    assert _args(tmp_path, "python") == ["-m", "hpc_mca", "train", f"/cfg/{HOSTILE}.yaml",
                                         f"text_field={HOSTILE}", ""]
    seen = _recorded_env(tmp_path, "python")
    assert seen["VIRTUAL_ENV"] == str(venv)
    assert seen["OMP_NUM_THREADS"] == "6"
    assert seen["PYTHONPATH"].split(":")[0] == str(REPO)
    assert seen["HPC_MCA_HOME"] == str(REPO)  # found from the launcher's own location
    assert not list(tmp_path.rglob("pwned"))


def test_explicit_python_wins(tmp_path: Path) -> None:
    tools = _tools(tmp_path, "py3")
    env = _env(tmp_path, tools, HPC_MCA_PYTHON=str(tools / "py3"),
               HPC_MCA_VENV=str(tmp_path / "none"), OMP_NUM_THREADS="3")
    assert _run(env, "smoke", "--tp", "2").returncode == 0
    assert _args(tmp_path, "py3") == ["-m", "hpc_mca", "smoke", "--tp", "2"]
    assert _recorded_env(tmp_path, "py3")["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_apptainer_wrapper(tmp_path: Path, runtime: str) -> None:
    tools = _tools(tmp_path, runtime)
    run_dir = tmp_path / f"runs/{HOSTILE}_1"
    env = _env(tmp_path, tools, HPC_MCA_CONTAINER_RUNTIME=runtime,
               HPC_MCA_CONTAINER_IMAGE=str(tmp_path / "images/my image.sif"),
               HPC_MCA_CONTAINER_MOUNTS="/data:/data,/scratch/my space",
               HPC_MCA_RUN_DIR=str(run_dir))
    done = _run(env, "train", "cfg.yaml", f"text_field={HOSTILE}")
    assert done.returncode == 0, done.stderr
    assert _args(tmp_path, runtime) == [
        "exec", "--bind", str(REPO), "--bind", str(run_dir), "--bind", "/data:/data",
        "--bind", "/scratch/my space", str(tmp_path / "images/my image.sif"),
        "python3", "-m", "hpc_mca", "train", "cfg.yaml", f"text_field={HOSTILE}"]


def test_enroot_wrapper_passes_the_rank_identity(tmp_path: Path) -> None:
    tools = _tools(tmp_path, "enroot")
    env = _env(tmp_path, tools, HPC_MCA_CONTAINER_RUNTIME="enroot",
               HPC_MCA_CONTAINER_IMAGE="nvcr.io+nvidia+pytorch+24.05.sqsh",
               HPC_MCA_PYTHON="/usr/bin/python", SLURM_PROCID="3", SLURM_STEP_ID="0")
    assert _run(env, "smoke").returncode == 0
    args = _args(tmp_path, "enroot")
    assert args[:3] == ["start", "--mount", f"{REPO}:{REPO}"]
    envs = {args[i + 1] for i, a in enumerate(args) if a == "--env"}
    assert {"SLURM_PROCID", "SLURM_STEP_ID", "HPC_MCA_HOME", "PYTHONPATH",
            "OMP_NUM_THREADS"} <= envs
    assert args[-5:] == ["nvcr.io+nvidia+pytorch+24.05.sqsh", "/usr/bin/python", "-m", "hpc_mca",
                         "smoke"]


@pytest.mark.parametrize("env_extra, message", [
    ({}, "usage: hpc-mca-rank COMMAND"),
    ({"HPC_MCA_CONTAINER_RUNTIME": "docker", "HPC_MCA_CONTAINER_IMAGE": "x"},
     "HPC_MCA_CONTAINER_RUNTIME=docker is not supported; valid: apptainer, singularity, enroot"),
    ({"HPC_MCA_CONTAINER_RUNTIME": "apptainer"}, "needs HPC_MCA_CONTAINER_IMAGE"),
])
def test_bad_settings_fail_with_one_line(tmp_path: Path, env_extra: dict, message: str) -> None:
    env = _env(tmp_path, _tools(tmp_path), **env_extra)
    done = _run(env) if not env_extra else _run(env, "smoke")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc-mca-rank: ") and message in lines[0], lines
