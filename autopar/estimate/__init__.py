"""Predicted step time, breakdown and memory of one parallel configuration (`estimate`)."""

from autopar.estimate.core import Estimate, EstimateOptions, estimate, estimate_graph

__all__ = ["Estimate", "EstimateOptions", "estimate", "estimate_graph"]
