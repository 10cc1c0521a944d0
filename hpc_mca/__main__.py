"""``python -m hpc_mca ...`` == ``hpc-mca ...`` (what srun and torchrun start on each rank)."""

from hpc_mca.cli import main

if __name__ == "__main__":
    main(prog_name="hpc-mca")
