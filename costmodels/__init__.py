"""Torch-free cost models: hardware dataclasses, NCCL-model constants and collective times.

Imports flow one way: autopar -> costmodels -> hwprofiles. Nothing here imports torch
(tests/unit/test_layering.py guards it).
"""

from costmodels.collectives import Collective, CollectiveEstimate, collective_time, estimate_collective
from costmodels.hardware import HardwareProfile
from costmodels.pipeline import PipelineSchedule, PipelineTimeline, simulate_pipeline

__all__ = ["Collective", "CollectiveEstimate", "HardwareProfile", "PipelineSchedule",
           "PipelineTimeline", "collective_time", "estimate_collective", "simulate_pipeline"]
