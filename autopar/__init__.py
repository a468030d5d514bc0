"""autopar: automatic parallelization planner and plan compiler for PyTorch training.

Public names are fixed by DESIGN.md §3; see README.md for a quickstart.
"""

from autopar import models
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.trace import trace
from autopar.estimate import Estimate, EstimateOptions, estimate

__all__ = ["Cluster", "Estimate", "EstimateOptions", "ParallelConfig", "estimate", "models", "trace"]
__version__ = "0.1.0"
