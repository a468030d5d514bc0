"""Predicted step time, breakdown and memory of one parallel configuration (`estimate`)."""

from autopar.estimate.core import (Estimate, EstimateOptions, EvalCache, ModelCosts, estimate,
                                   estimate_graph, evaluate)

__all__ = ["Estimate", "EstimateOptions", "EvalCache", "ModelCosts", "estimate", "estimate_graph",
           "evaluate"]
