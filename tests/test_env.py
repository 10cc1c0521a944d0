"""Rank environment: Slurm steps, torchrun, single process (pure, no torch)."""

import subprocess
import sys

from hpc_mca.runtime import env as rank_env

SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_RESTART_COUNT": "2",
}


def test_slurm_step():
    e = rank_env.from_environ(SLURM_STEP)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (3, 4, 1, 2)
    assert e.master_addr == "gpu07"
    assert e.master_port == rank_env.port_for_job("4242")
    assert (e.launcher, e.job_id, e.restart_count) == ("slurm", "4242", 2)
    assert e.init_method == f"tcp://gpu07:{e.master_port}"


def test_slurm_uneven_tasks_per_node():
    env = dict(SLURM_STEP, SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_NODEID="1", SLURM_PROCID="3")
    assert rank_env.from_environ(env).local_world_size == 1
    assert rank_env.from_environ(dict(env, SLURM_NODEID="0")).local_world_size == 3


def test_explicit_master_port_wins():
    assert rank_env.from_environ(dict(SLURM_STEP, MASTER_PORT="23456")).master_port == 23456


def test_batch_shell_is_not_a_rank():
    # The batch script itself has SLURM_NTASKS=4 but is one process: treating it as rank 0 of
    # 4 would hang forever in the rendezvous.
    env = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    e = rank_env.from_environ(env)
    assert (e.launcher, e.world_size, e.rank) == ("single", 1, 0)


def test_torchrun_inside_slurm_wins():
    env = dict(SLURM_STEP, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
               MASTER_ADDR="node1", MASTER_PORT="29400")
    e = rank_env.from_environ(env)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.local_world_size) == ("torchrun", 5, 8, 1, 4)
    assert (e.master_addr, e.master_port, e.job_id) == ("node1", 29400, "4242")


def test_ports_differ_between_jobs_and_stay_in_window():
    ports = {rank_env.port_for_job(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100
    assert all(15000 <= p < 32768 for p in ports)
    assert rank_env.port_for_job("77_3") != rank_env.port_for_job("77_4")


def test_array_job_id():
    env = dict(SLURM_STEP, SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3")
    assert rank_env.from_environ(env).job_id == "77_3"


def test_nodelist_parsing():
    assert rank_env.parse_nodelist("n[1-3,5],login1") == ["n1", "n2", "n3", "n5", "login1"]
    assert rank_env.parse_nodelist("gpu[001-002]") == ["gpu001", "gpu002"]


def test_no_torch_imported():
    code = "import sys, hpc_mca.runtime.env; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_more_ranks_than_gpus_on_a_node_is_one_line():
    """Checked before the rendezvous on CUDA machines (NCCL would fail later with "invalid
    usage"); the rule itself is pure, so it is tested here without a GPU."""
    from hpc_mca.runtime.distributed import ranks_per_gpu_violations

    assert ranks_per_gpu_violations(8, 8) == [] and ranks_per_gpu_violations(1, 8) == []
    assert ranks_per_gpu_violations(2, 1) == [
        "2 ranks on this node but 1 GPU(s) visible: NCCL needs one GPU per rank; valid: at most "
        "1 ranks per node (--ntasks-per-node / --nproc-per-node, or --gpus-per-node for hpc-mca "
        "submit)"]
