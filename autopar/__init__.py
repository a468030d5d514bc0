"""autopar: automatic parallelization planner and plan compiler for PyTorch training.

Public names are fixed by DESIGN.md §3; see README.md for a quickstart.
"""

from autopar.cluster import Cluster

__all__ = ["Cluster"]
__version__ = "0.1.0"
