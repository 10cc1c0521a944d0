"""The CLI stays light: importing it and printing help never imports torch or megatron."""

import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "megatron", "transformers")


def _run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_and_help_do_not_import_torch():
    out = _run_python(
        "import sys\n"
        "import hpc_mca.cli\n"
        "from click.testing import CliRunner\n"
        "for args in (['--help'], ['smoke', '--help']):\n"
        "    result = CliRunner().invoke(hpc_mca.cli.main, args)\n"
        "    assert result.exit_code == 0, result.output\n"
        "    print(result.output)\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    assert "HEAVY []" in out
    assert "smoke" in out and "--tp" in out


def test_console_script_help():
    script = Path(sys.executable).with_name("hpc-mca")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "Usage: hpc-mca" in proc.stdout


def test_bin_on_path_is_enough(tmp_path: Path):
    """bin/hpc-mca runs the venv's command without activating it (README: PATH=bin:$PATH);
    without an environment it says how to make one."""
    import os

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{repo / 'bin'}:/usr/bin:/bin",
           "HPC_MCA_VENV": str(Path(sys.executable).parents[1])}
    proc = subprocess.run(["hpc-mca", "--help"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "Usage: hpc-mca" in proc.stdout, proc.stderr
    env["HPC_MCA_VENV"] = str(tmp_path / "nowhere")
    proc = subprocess.run(["hpc-mca", "status"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "run " + str(repo / "bin" / "setup-env") + " first" in proc.stderr


def test_unknown_command_names_the_valid_ones():
    script = Path(sys.executable).with_name("hpc-mca")
    proc = subprocess.run([str(script), "smok"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "No such command 'smok'" in proc.stderr


OPS_COMMANDS = ("plan", "submit", "status", "logs", "cancel", "tensorboard")


def test_operator_commands_never_import_torch(tmp_path: Path):
    """Login-node commands: --help of each, and a whole `plan` over a run config (which loads
    the trainer's config module and the planner), import no torch/megatron/transformers."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, '
        '"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, '
        '"vocab_size": 128256}')
    config = tmp_path / "run.yaml"
    (tmp_path / "d.jsonl").write_text('{"instruction": "1+1=", "output": "2"}\n')
    config.write_text(f"model_name_or_path: {model}\ndataset: d.jsonl\nbf16: true\n"
                      "cutoff_len: 8192\nglobal_batch_size: 64\n")
    out = _run_python(
        "import sys\n"
        "import hpc_mca.cli\n"
        "from click.testing import CliRunner\n"
        f"for name in {OPS_COMMANDS!r}:\n"
        "    result = CliRunner().invoke(hpc_mca.cli.main, [name, '--help'])\n"
        "    assert result.exit_code == 0, result.output\n"
        f"result = CliRunner().invoke(hpc_mca.cli.main, ['plan', {str(config)!r}, '--nodes', '2',"
        " '--sbatch'])\n"
        "assert result.exit_code == 0, result.output\n"
        "print(result.output)\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    assert "HEAVY []" in out
    assert "#SBATCH --nodes=2" in out and "  layout      TP2 PP1 CP1 DP8  (planned" in out
