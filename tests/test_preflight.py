"""The preflight (``HPC_MCA_PREFLIGHT=1``, ``hpc-mca submit --preflight``): every node checks
itself and joins an all-reduce before training; the batch node's verdict excludes the nodes
that failed and requeues the job.

* the verdict on written reports: who is blamed (a failed check, a missing or stale report,
  a node the others name as never joining the all-reduce, not the ones that waited for it);
* the CPU node check on two local processes (the all-reduce between them): both pass; with a
  test hook one node's matmul is off by 1, it fails with that detail and the other passes;
  a node alone names the absent one after the rendezvous timeout;
* ``submit --preflight`` sets the knob and ``resume`` keeps it;
* on the local Slurm: a 2-node job whose node 0 fails at its first start is requeued once
  without that node and trains to the uninterrupted run's numbers.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_mca.slurm.errors import OpsError
from hpc_mca.slurm.preflight import judge, read_reports, verdict_for_job

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "tests" / "checkpoint_hooks"
NODES = ("localhost", "127.0.0.1")
"""Two names of this machine: two "nodes" whose first one hosts the rendezvous."""


def _report(node: str, *, ok: bool = True, failing: str | None = None, detail: str = "",
            absent: list[str] | None = None, restart: int = 0, started: float = 1000.0,
            seconds: float = 2.0) -> dict:
    names = ["matmul cpu", "host memory", "run dir", "all-reduce"]
    checks = [{"name": n, "ok": n != failing, "detail": detail if n == failing else "fine",
               "seconds": 0.1} for n in names]
    return {"node": node, "restart": restart, "ok": ok and failing is None, "checks": checks,
            "absent": absent or [], "started": started, "seconds": seconds}


def _write(run_dir: Path, *reports: dict) -> None:
    (run_dir / "preflight").mkdir(parents=True, exist_ok=True)
    for report in reports:
        (run_dir / "preflight" / f"{report['node']}.json").write_text(json.dumps(report))


# --- the verdict ------------------------------------------------------------------------------


def test_the_verdict_blames_failed_and_silent_nodes_and_hands_them_to_the_exclusion(
        tmp_path: Path) -> None:
    _write(tmp_path, _report("n1"), _report("n2", failing="matmul cpu",
                                            detail="matmul on cpu off by 3: 2 of 9 entries"),
           _report("n4", restart=1))  # a report of another start: stale
    env = {"HPC_MCA_RUN_DIR": str(tmp_path), "HPC_MCA_JOB_NODES": "n1,n2,n3,n4",
           "HPC_MCA_USABLE_NODES": ",".join(f"n{i}" for i in range(1, 10)),
           "HPC_MCA_MAX_EXCLUDED_NODES": "5", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "77",
           "SLURM_RESTART_COUNT": "0"}
    verdict, code = verdict_for_job(env)
    assert code == 3 and not verdict.passed
    assert verdict.failed == {"n2": "matmul on cpu off by 3: 2 of 9 entries",
                              "n3": "sent no report", "n4": "sent no report"}
    assert verdict.line == ("preflight: n2 failed (matmul on cpu off by 3: 2 of 9 entries); "
                            "n3 sent no report; n4 sent no report")
    records = json.loads((tmp_path / "excluded_nodes.json").read_text())["nodes"]
    assert [(r["node"], r["reason"], r["job"]) for r in records] == [
        (n, verdict.line, "77") for n in ("n2", "n3", "n4")]
    lines = (tmp_path / "requeue_verdict").read_text().splitlines()
    assert lines[1:] == ["exclude=n2,n3,n4", "end="], lines
    assert lines[0].startswith(f"why={verdict.line}; excluding n2,n3,n4 from the next start")


def test_a_failed_node_the_budget_cannot_exclude_ends_the_job(tmp_path: Path) -> None:
    (tmp_path / "excluded_nodes.json").write_text(json.dumps({"nodes": [
        {"node": "n7", "reason": "an earlier hang", "job": "77", "restart": 0, "time": 1.0}]}))
    _write(tmp_path, _report("n1"), _report("n2", failing="host memory", detail="0.2 GiB"))
    env = {"HPC_MCA_RUN_DIR": str(tmp_path), "HPC_MCA_JOB_NODES": "n1,n2",
           "HPC_MCA_USABLE_NODES": "n1,n2,n3,n4", "HPC_MCA_JOB_EXCLUDED": "n7",
           "HPC_MCA_MAX_EXCLUDED_NODES": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77"}
    verdict, code = verdict_for_job(env)
    assert code == 3 and verdict.failed == {"n2": "0.2 GiB"}
    lines = (tmp_path / "requeue_verdict").read_text().splitlines()
    assert lines[1:] == ["exclude=", "end=not requeued onto n2 (the budget of excluded nodes, "
                                     "HPC_MCA_MAX_EXCLUDED_NODES=1, is spent)"], lines
    assert [r["node"] for r in json.loads((tmp_path / "excluded_nodes.json").read_text())["nodes"]
            ] == ["n7"]


def test_the_verdict_passes_when_every_node_did_and_says_how_long_it_took(tmp_path: Path) -> None:
    _write(tmp_path, _report("n1", started=1000.0, seconds=2.5),
           _report("n2", started=1001.0, seconds=3.25))
    env = {"HPC_MCA_RUN_DIR": str(tmp_path), "HPC_MCA_JOB_NODES": "n1,n2"}
    verdict, code = verdict_for_job(env)
    assert (code, verdict.line) == (0, "preflight: 2 node(s) passed in 4.2 s")
    assert not (tmp_path / "requeue_verdict").exists()
    assert not (tmp_path / "excluded_nodes.json").exists()


def test_an_absent_node_is_blamed_not_the_ones_that_waited_for_it() -> None:
    waited = "all-reduce across 3 node(s) failed after 60.0 s; never joined: n3: timeout"
    reports = {"n1": _report("n1", failing="all-reduce", detail=waited, absent=["n3"]),
               "n2": _report("n2", failing="all-reduce", detail=waited, absent=["n3"])}
    # Silent and named: what the others saw, not merely that it wrote nothing.
    verdict = judge(["n1", "n2", "n3"], reports)
    assert verdict.failed == {"n3": "never joined the all-reduce"}
    assert verdict.line == "preflight: n3 never joined the all-reduce"
    # It came late (its own all-reduce failed too): still it, by the others' word.
    reports["n3"] = _report("n3", failing="all-reduce", detail="the rendezvous did not answer")
    assert judge(["n1", "n2", "n3"], reports).failed == {"n3": "never joined the all-reduce"}
    # Everyone joined and the all-reduce still failed: the nodes that saw it.
    broken = {n: _report(n, failing="all-reduce", detail=f"{n}: returned [1.0, 0.0]")
              for n in ("n1", "n2")}
    assert judge(["n1", "n2"], broken).failed == {"n1": "n1: returned [1.0, 0.0]",
                                                  "n2": "n2: returned [1.0, 0.0]"}


def test_the_verdict_reads_the_node_list_and_refuses_a_missing_one_in_one_line(
        tmp_path: Path) -> None:
    with pytest.raises(OpsError, match=r"^HPC_MCA_JOB_NODES and SLURM_JOB_NODELIST are empty; "
                                       r"valid: the job's nodes"):
        verdict_for_job({"HPC_MCA_RUN_DIR": str(tmp_path)})
    # Without the batch shell's list, Slurm's: n2 and n3 sent no report.
    _write(tmp_path, _report("n1"))
    verdict, _ = verdict_for_job({"HPC_MCA_RUN_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "n[1-3]",
                                  "HPC_MCA_USABLE_NODES": "n1,n2,n3,n4,n5,n6",
                                  "SLURM_JOB_NUM_NODES": "3"})
    assert verdict.failed == {"n2": "sent no report", "n3": "sent no report"}
    with pytest.raises(OpsError, match=r"^HPC_MCA_RUN_DIR is not set; valid: the run directory"):
        verdict_for_job({"HPC_MCA_JOB_NODES": "n1"})


# --- the node check ---------------------------------------------------------------------------


def test_local_checks_fail_on_an_error_and_on_a_check_that_hangs() -> None:
    from hpc_mca.runtime.node_check import run_local_checks

    def broken() -> tuple[bool, str]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def hangs() -> tuple[bool, str]:
        time.sleep(10)  # a daemon thread: left behind, as a hung device's check would be
        return True, "never"

    checks = run_local_checks([("fine", lambda: (True, "ok")), ("broken", broken),
                               ("hangs", hangs), ("after", lambda: (True, "ok"))], timeout_s=1.0)
    assert [(c.name, c.ok) for c in checks] == [("fine", True), ("broken", False),
                                                ("hangs", False)]
    assert checks[1].detail == ("broken raised RuntimeError: CUDA error: an illegal memory "
                                "access was encountered")
    assert checks[2].detail == "hangs did not finish within 1 s"


def test_the_expected_gpu_count_comes_from_the_allocation() -> None:
    from hpc_mca.runtime.node_check import expected_gpus

    assert expected_gpus({"CUDA_VISIBLE_DEVICES": "0,1,5", "SLURM_GPUS_ON_NODE": "8"}) == (
        3, "CUDA_VISIBLE_DEVICES")
    assert expected_gpus({"SLURM_GPUS_ON_NODE": "4"}) == (4, "SLURM_GPUS_ON_NODE")
    assert expected_gpus({"CUDA_VISIBLE_DEVICES": ""}) == (None, "")


def test_gpu_checks_name_the_count_the_device_short_of_memory_and_the_wrong_matmul(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU branch's logic, with the CUDA queries and the device's product stood in for
    (no GPU here): 2 devices visible of the 3 allocated, cuda:1 short of memory and its
    matmul off in one entry."""
    import torch

    from hpc_mca.runtime import node_check

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda i: (79 * gib, 80 * gib) if i == 0 else (30 * gib, 80 * gib))

    def product(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> torch.Tensor:
        out = a @ b
        if device.index == 1:
            out[3, 5] -= 0.5
        return out

    monkeypatch.setattr(node_check, "_product", product)
    plan = node_check.local_plan({"CUDA_VISIBLE_DEVICES": "0,1,2"}, tmp_path)
    checks = {c.name: (c.ok, c.detail) for c in node_check.run_local_checks(plan)}
    assert checks == {
        "gpu count": (False, "2 GPU(s) visible, the allocation gave 3 (CUDA_VISIBLE_DEVICES)"),
        "memory cuda:0": (True, "cuda:0 has 79.0 of 80.0 GiB free"),
        "matmul cuda:0": (True, "512x512 on cuda:0 exact"),
        "memory cuda:1": (False, "cuda:1 has 30.0 of 80.0 GiB free, under 64.0 GiB"),
        "matmul cuda:1": (False, "matmul on cuda:1 off by 0.5: 1 of 262144 entries differ "
                                 "from the exact product"),
        "host memory": checks["host memory"], "run dir": (True, f"{tmp_path} writable")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = node_check.local_plan({"SLURM_GPUS_ON_NODE": "4"}, tmp_path)
    assert node_check.run_local_checks(plan)[0].detail == (
        "CUDA is not available but the allocation gave 4 GPU(s) (SLURM_GPUS_ON_NODE)")


def test_a_node_id_outside_the_node_list_is_refused_in_one_line(tmp_path: Path) -> None:
    from hpc_mca.runtime.node_check import NodeEnv, PreflightInputError

    with pytest.raises(PreflightInputError, match=r"^SLURM_NODEID='2' is not valid; valid: "
                                                  r"0\.\.1 \(HPC_MCA_JOB_NODES=n1,n2\)$"):
        NodeEnv.from_environ({"HPC_MCA_RUN_DIR": str(tmp_path), "HPC_MCA_JOB_NODES": "n1,n2",
                              "SLURM_NODEID": "2"})


def free_job_id() -> str:
    """A job id whose preflight port is free on this machine now."""
    from hpc_mca.runtime.node_check import preflight_port

    rng = random.Random()
    for _ in range(100):
        job_id = str(rng.randint(10**6, 10**7))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", preflight_port(job_id)))
            except OSError:
                continue
            return job_id
    raise RuntimeError("no free preflight port")


def node_env(run_dir: Path, node_id: int, job_id: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM"))}
    env.update(HPC_MCA_RUN_DIR=str(run_dir), HPC_MCA_JOB_NODES=",".join(NODES),
               SLURMD_NODENAME=NODES[node_id], SLURM_NODEID=str(node_id), SLURM_JOB_ID=job_id,
               SLURM_RESTART_COUNT="0", PYTHONWARNINGS="ignore", **extra)
    return env


def _check_nodes(run_dir: Path, **extra: str) -> list[subprocess.CompletedProcess]:
    """``hpc-mca preflight`` as the job's two nodes (two processes here)."""
    job_id = free_job_id()
    procs = [subprocess.Popen([sys.executable, "-m", "hpc_mca", "preflight"],
                              env=node_env(run_dir, i, job_id, **extra), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(len(NODES))]
    outputs = [p.communicate(timeout=180) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out)
            for p, out in zip(procs, outputs)]


def _verdict(run_dir: Path) -> subprocess.CompletedProcess:
    env = node_env(run_dir, 0, "1", HPC_MCA_USABLE_NODES="localhost,127.0.0.1,n3,n4",
                    SLURM_JOB_NUM_NODES="2")
    return subprocess.run([sys.executable, "-m", "hpc_mca", "preflight", "--verdict"], env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_cpu_node_check_passes_on_this_machine(tmp_path: Path) -> None:
    done = _check_nodes(tmp_path)
    for node, proc in zip(NODES, done):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert re.fullmatch(rf"preflight {re.escape(node)}: ok in [\d.]+ s \(matmul cpu [\d.]+ s, "
                            r"host memory [\d.]+ s, run dir [\d.]+ s, all-reduce [\d.]+ s\)\n",
                            proc.stdout), proc.stdout
    reports = read_reports(tmp_path, restart=0)
    assert sorted(reports) == sorted(NODES)
    for report in reports.values():
        assert report["ok"] and report["absent"] == [] and report["nodes"] == list(NODES)
        details = {c["name"]: c["detail"] for c in report["checks"]}
        assert details["matmul cpu"] == "512x512 on cpu exact"
        assert details["run dir"] == f"{tmp_path} writable"
        assert re.fullmatch(r"2 node\(s\) in [\d.]+ s", details["all-reduce"])
    verdict = _verdict(tmp_path)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert re.fullmatch(r"preflight: 2 node\(s\) passed in [\d.]+ s\n", verdict.stdout)


def test_a_failing_check_is_reported_with_its_detail_and_the_other_node_passes(
        tmp_path: Path) -> None:
    done = _check_nodes(tmp_path, PYTHONPATH=str(HOOKS), HPC_MCA_TEST_PREFLIGHT_FAIL="1@0")
    assert [p.returncode for p in done] == [0, 1], [p.stdout + p.stderr for p in done]
    wrong = "matmul on cpu off by 1: 1 of 262144 entries differ from the exact product"
    assert done[1].stdout == f"preflight 127.0.0.1: FAILED: {wrong}\n"
    reports = read_reports(tmp_path, restart=0)
    failed = reports["127.0.0.1"]
    assert not failed["ok"] and not failed["local_ok"]
    # It still joined the all-reduce: the other node was not left waiting.
    assert [(c["name"], c["ok"]) for c in failed["checks"]] == [
        ("matmul cpu", False), ("host memory", True), ("run dir", True), ("all-reduce", True)]
    assert reports["localhost"]["ok"]
    verdict = _verdict(tmp_path)
    assert verdict.returncode == 3, verdict.stdout + verdict.stderr
    assert verdict.stdout == f"preflight: 127.0.0.1 failed ({wrong})\n"
    assert (tmp_path / "requeue_verdict").read_text().splitlines()[1] == "exclude=127.0.0.1"


def test_a_node_alone_names_the_absent_one_after_the_rendezvous_timeout(tmp_path: Path) -> None:
    code = ("from hpc_mca.runtime.node_check import run\n"
            "raise SystemExit(0 if run(rendezvous_timeout_s=3)['ok'] else 1)\n")
    done = subprocess.run([sys.executable, "-c", code], env=node_env(tmp_path, 0, free_job_id()),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.match(r"preflight localhost: FAILED: all-reduce across 2 node\(s\) failed after "
                    r"[\d.]+ s; never joined: 127\.0\.0\.1: ", done.stdout), done.stdout
    report = read_reports(tmp_path)["localhost"]
    assert report["absent"] == ["127.0.0.1"] and report["local_ok"]
    verdict = judge(list(NODES), read_reports(tmp_path))
    assert verdict.failed == {"127.0.0.1": "never joined the all-reduce"}


# --- submit and resume ------------------------------------------------------------------------


def test_submit_preflight_sets_the_knob_and_resume_keeps_it(tmp_path: Path) -> None:
    from dataclasses import asdict

    from hpc_mca.slurm.continuation import _submit_options
    from hpc_mca.slurm.jobplan import PlanOptions, make_job_plan
    from hpc_mca.slurm.manifest import Run
    from hpc_mca.slurm.submit import SubmitOptions, render_job

    demo = REPO / "hpc_mca" / "assets" / "demo" / "sft_addition.yaml"
    job = make_job_plan(PlanOptions(nodes=2, gpus_per_node=1, gpu="CPU"), demo)
    options = SubmitOptions(runs_root=tmp_path, home=REPO, preflight=True)
    rendered = render_job(job, options)
    assert rendered.knobs["HPC_MCA_PREFLIGHT"] == "1"
    assert "\nHPC_MCA_PREFLIGHT=${HPC_MCA_PREFLIGHT:-1}\n" in rendered.script
    plain = render_job(job, SubmitOptions(runs_root=tmp_path, home=REPO))
    assert "HPC_MCA_PREFLIGHT" not in plain.knobs
    assert "\nHPC_MCA_PREFLIGHT=${HPC_MCA_PREFLIGHT:-0}\n" in plain.script
    for knobs, kept in ((rendered.knobs, True), (plain.knobs, False)):
        run = Run(tmp_path / "r_1", "1", None, {"knobs": knobs, "sbatch": asdict(rendered.sbatch),
                                                 "job_name": "r"})
        assert _submit_options(run, tmp_path, {}).preflight is kept
    with pytest.raises(OpsError, match=r"^--preflight with the rank command 'smoke'; valid: "):
        render_job(job, SubmitOptions(runs_root=tmp_path, home=REPO, preflight=True,
                                      rank_command=("smoke",)))


def test_the_batch_script_clears_the_reports_by_their_contract_name() -> None:
    """A start's verdict reads only its own nodes' reports: the shell removes the directory
    the node check writes (hpc_mca.rundir.PREFLIGHT_DIR) before the preflight runs."""
    from hpc_mca.rundir import JOB_NODES_ENV, PREFLIGHT_DIR
    from hpc_mca.slurm.script import render_script

    script = render_script()
    removed = script.index(f'"${{HPC_MCA_RUN_DIR}}/{PREFLIGHT_DIR}"')
    assert script.startswith("rm -rf ", script.rindex("\n", 0, removed) + 1)
    assert removed < script.index('"${launcher}" preflight || true')
    assert f' {JOB_NODES_ENV}="${{nodes}}"' in script  # exported to the node check and the verdict


# --- on the local Slurm -----------------------------------------------------------------------


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                         text=True, check=True).stdout
    return out.split()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_node_failing_its_preflight_is_excluded_and_the_run_trains_on_the_others(
        slurm_cluster: None, tmp_path: Path) -> None:
    import fault_campaign as campaign
    import slurm_cluster as slurm
    from trainer_fixtures import make_model_dir, make_sft_data, run_train, write_config

    config = write_config(tmp_path, make_model_dir(tmp_path, layers=2),
                          make_sft_data(tmp_path, 64, seed=1, name="train"),
                          training={"max_steps": 6, "logging_steps": 1, "save_steps": 3,
                                    "report_to": ["none"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPC_MCA_", "SLURM_"))}
    # HPC_MCA_PLAN=given: compared with a reference run that has no job-start plan.
    env.update(HPC_MCA_HOME=str(REPO), PYTHONWARNINGS="ignore", HPC_MCA_DIST_TIMEOUT="120",
               PYTHONPATH=str(HOOKS), HPC_MCA_PLAN="given", HPC_MCA_PREFLIGHT="1",
               HPC_MCA_TEST_PREFLIGHT_FAIL="0@0", HPC_MCA_RUNS_ROOT=str(tmp_path / "runs"))
    done = subprocess.run(["sbatch", "--parsable", "--job-name=preflight", "--nodes=2",
                           "--ntasks-per-node=1", "--time=10", f"--output={tmp_path}/%x_%j.out",
                           f"--chdir={tmp_path}", str(campaign.TEMPLATE), str(config)],
                          env=env, capture_output=True, text=True, check=True)
    job_id = done.stdout.strip().split(";")[0]
    reference = run_train(config, tmp_path / "reference", 2)  # while the job runs
    assert reference.returncode == 0, reference.stderr[-3000:]
    state = slurm.wait_for_job(job_id, timeout=300)
    log = (tmp_path / f"preflight_{job_id}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert slurm.job_restart_count(job_id) == 1, log[-4000:]
    starts = [hostnames(m.group(1)) for m in
              re.finditer(r"^hpc-mca \| nodes +2: (\S+)$", log, re.M)]
    assert len(starts) == 2, log
    bad = starts[0][0]  # SLURM_NODEID 0 of the first start
    wrong = "matmul on cpu off by 1: 1 of 262144 entries differ from the exact product"
    assert f"preflight {bad}: FAILED: {wrong}" in log
    assert f"preflight: {bad} failed ({wrong})" in log
    assert f"hpc-mca | exclude        the next start runs without {bad}" in log
    assert bad not in starts[1], starts
    assert re.search(r"^preflight: 2 node\(s\) passed in [\d.]+ s$", log, re.M), log
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                           text=True, check=True).stdout
    assert f" ExcNodeList={bad} " in shown, shown
    run_dir = tmp_path / "runs" / f"preflight_{job_id}"
    records = json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"]
    assert [(r["node"], r["reason"], r["restart"]) for r in records] == [
        (bad, f"preflight: {bad} failed ({wrong})", 0)]
    assert campaign.numbers(run_dir) == campaign.numbers(tmp_path / "reference")
    assert len(campaign.numbers(run_dir)) == 6
    print(f"\njob {job_id}: first start {starts[0]}, {bad} excluded; second start {starts[1]}")
