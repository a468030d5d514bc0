"""Plans: the chosen parallelization as plain, versioned, reviewable data."""

from autopar.plan.export import EXPORT_FORMATS, ExportResult, export_plan
from autopar.plan.placements import (fp8_weights, fused_projections, megatron_tp_placements,
                                     param_placements, replicated_sublayers,
                                     summed_row_weights)
from autopar.plan.plan import PLAN_VERSION, Plan, check_plan, load_plan

__all__ = ["EXPORT_FORMATS", "ExportResult", "PLAN_VERSION", "Plan", "check_plan",
           "export_plan", "fp8_weights", "fused_projections", "load_plan", "megatron_tp_placements",
           "param_placements", "replicated_sublayers", "summed_row_weights"]
