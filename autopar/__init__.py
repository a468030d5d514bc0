"""autopar: automatic parallelization planner and plan compiler for PyTorch training.

Public names are those in ``__all__`` below; see README.md for a quickstart.
"""

from autopar import models
from autopar.api import compile
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from autopar.errors import InvalidConfigError, NoPlanFitsError, PlanningError
from autopar.estimate import Estimate, EstimateOptions, estimate
from autopar.estimate.software import SOFTWARE
from autopar.plan import Plan, load_plan
from autopar.plan.explain import diff
from autopar.search.outer import SearchSettings
from autopar.trace import trace

__all__ = ["Cluster", "Estimate", "EstimateOptions", "InvalidConfigError", "NoPlanFitsError",
           "ParallelConfig", "Plan", "PlanningError", "SOFTWARE", "SearchSettings", "compile",
           "diff", "estimate", "load_plan", "models", "trace"]
__version__ = "0.1.0"
