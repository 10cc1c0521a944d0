"""modules/: the Lmod (.lua) and Tcl modulefiles, loaded by a real Lmod (Debian's lmod)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")


def _ensure_lmod() -> None:
    if LMOD_INIT.is_file():
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", "-c", "apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
                        "apt-get install -y -qq --no-install-recommends lmod"],
                       capture_output=True, check=False, timeout=600)
    if not LMOD_INIT.is_file():
        pytest.skip("Lmod is not installed (bin/test installs Debian's lmod package)")


def _lmod_bash(script: str, modules_dir: Path) -> dict[str, str]:
    """Run ``script`` in a bash with Lmod initialised and ``module use modules_dir``; return
    the KEY=VALUE lines it prints."""
    _ensure_lmod()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPC_MCA_", "LMOD", "MODULE", "_ModuleTable", "__LMOD"))}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"  # no venv: the module has to add it
    env["HOME"] = str(modules_dir.parent)
    text = f"source {LMOD_INIT}\nmodule use {modules_dir}\n{script}"
    done = subprocess.run(["bash", "--noprofile", "--norc", "-c", text], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


LOAD = """\
module load hpc-mca
echo "hpc_mca=$(command -v hpc-mca)"
echo "rank=$(command -v hpc-mca-rank)"
echo "home=${HPC_MCA_HOME}"
echo "runs_root=${HPC_MCA_RUNS_ROOT}"
echo "gpu=${HPC_MCA_GPU}"
echo "loaded=$(module -t list 2>&1 | tr '\\n' ' ')"
module unload hpc-mca
echo "after_home=${HPC_MCA_HOME:-}"
echo "after_hpc_mca=$(command -v hpc-mca || true)"
"""


def test_lmod_loads_the_lua_modulefile() -> None:
    seen = _lmod_bash(LOAD, REPO / "modules")
    # bin/ comes first on PATH: its hpc-mca runs the venv's (whose bin/ is on PATH too).
    assert seen["hpc_mca"] == str(REPO / "bin" / "hpc-mca")
    assert seen["rank"] == str(REPO / "bin" / "hpc-mca-rank")
    assert seen["home"] == str(REPO)
    assert seen["runs_root"] == str(REPO / "hpc-mca-runs")  # $HOME/hpc-mca-runs (HOME=REPO here)
    assert seen["gpu"] == "H100-80GB"
    assert "hpc-mca/0.1.0" in seen["loaded"]
    assert seen["after_home"] == "" and seen["after_hpc_mca"] == ""


def test_lmod_reads_the_tcl_modulefile(tmp_path: Path) -> None:
    """The Tcl file alone (as an Environment Modules site would use it), in a copy of the
    checkout's layout: modules/hpc-mca/0.1.0 next to bin/ and .venv/."""
    (tmp_path / "modules" / "hpc-mca").mkdir(parents=True)
    shutil.copy(REPO / "modules" / "hpc-mca" / "0.1.0", tmp_path / "modules" / "hpc-mca")
    (tmp_path / "bin").symlink_to(REPO / "bin")
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    seen = _lmod_bash(LOAD, tmp_path / "modules")
    assert seen["hpc_mca"] == str(tmp_path / "bin" / "hpc-mca")
    assert seen["rank"] == str(tmp_path / "bin" / "hpc-mca-rank")
    assert seen["home"] == str(tmp_path)
    assert seen["after_home"] == "" and seen["after_hpc_mca"] == ""


def test_loaded_module_runs_the_cli() -> None:
    seen = _lmod_bash("module load hpc-mca\necho \"out=$(hpc-mca --help | head -1)\"\n",
                      REPO / "modules")
    assert seen["out"] == "Usage: hpc-mca [OPTIONS] COMMAND [ARGS]..."


def test_rank_launcher_loads_modules_by_name(tmp_path: Path) -> None:
    """bin/hpc-mca-rank's HPC_MCA_MODULES loads modules (here hpc-mca itself) before the rank."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/bin/bash\necho "gpu=${HPC_MCA_GPU:-}"\necho "args=$*"\n')
    fake_python.chmod(0o755)
    script = (f"export HPC_MCA_MODULES=hpc-mca HPC_MCA_PYTHON={fake_python}\n"
              f"{REPO}/bin/hpc-mca-rank smoke --tp 2\n")
    seen = _lmod_bash(script, REPO / "modules")
    assert seen["gpu"] == "H100-80GB"
    assert seen["args"] == "-m hpc_mca smoke --tp 2"
