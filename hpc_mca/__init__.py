"""hpc-mca: Megatron-Core training on Slurm clusters.

Importing this package must stay cheap (no torch, no megatron): login-node commands such as
``hpc-mca --help`` and ``hpc-mca plan`` import it.
"""

__version__ = "0.1.0"
