-- hpc-mca 0.1.0: Megatron-Core training on Slurm (Lmod modulefile).
--
--   module use /path/to/hpc-mca/modules
--   module load hpc-mca
--
-- Puts the checkout's bin/ (launchers) and its virtual environment's bin/ (the hpc-mca
-- command) on PATH and sets the HPC_MCA_* defaults the CLI and sbatch/train.sbatch read.
-- The checkout is found from this file's location (modules/hpc-mca/<version>.lua); sites
-- edit the defaults below (or override them in the environment after loading).

whatis("Name: hpc-mca")
whatis("Version: 0.1.0")
whatis("Description: plan, submit and operate Megatron-Core training jobs on Slurm")
help([[
hpc-mca: Megatron-Core training on Slurm clusters.
  hpc-mca plan / submit / status / logs / cancel / tensorboard
  sbatch --nodes 2 $HPC_MCA_HOME/sbatch/train.sbatch CONFIG.yaml [key=value ...]
]])

local home = pathJoin(myFileName():match("(.*)/modules/[^/]+/[^/]+$"))
local venv = os.getenv("HPC_MCA_VENV") or pathJoin(home, ".venv")

-- Site defaults ------------------------------------------------------------------------
local runs_root = pathJoin(os.getenv("SCRATCH") or os.getenv("HOME") or "/tmp", "hpc-mca-runs")
local partition = ""   -- e.g. "gpu"; empty: the cluster's default partition
local gpu = "H100-80GB"  -- planner preset: H100-80GB, H200-141GB, A100-40GB, A100-80GB, CPU
-- ----------------------------------------------------------------------------------------

setenv("HPC_MCA_HOME", home)
setenv("HPC_MCA_VENV", venv)
setenv("HPC_MCA_RUNS_ROOT", runs_root)
setenv("HPC_MCA_GPU", gpu)
if partition ~= "" then
    setenv("HPC_MCA_PARTITION", partition)
end
prepend_path("PATH", pathJoin(venv, "bin"))
prepend_path("PATH", pathJoin(home, "bin"))
