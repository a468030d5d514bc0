"""Plans: the chosen parallelization as plain, versioned, reviewable data."""

from autopar.plan.placements import megatron_tp_placements, param_placements
from autopar.plan.plan import PLAN_VERSION, Plan, check_plan, load_plan

__all__ = ["PLAN_VERSION", "Plan", "check_plan", "load_plan", "megatron_tp_placements",
           "param_placements"]
