"""autopar.runtime: applies a Plan to a model inside each rank on PyTorch's distributed engine
(DeviceMesh, DTensor tensor/sequence parallel, FSDP2 / DDP, torch.distributed.pipelining).

This package is the only part of autopar that imports ``torch.distributed``; generated training
scripts (``autopar.codegen``) import it rather than inlining it.
"""

from autopar.runtime.apply import (
    RuntimeModel,
    apply_plan,
    check_world_size,
    init_distributed,
    lm_loss,
    model_logits,
    precision,
    shutdown,
)
from autopar.runtime.checkpoint import checkpoint_info, load_checkpoint, save_checkpoint
from autopar.runtime.memory import StateCounter
from autopar.runtime.train import (
    PEAK_MEMORY_MEANS,
    make_optimizer,
    peak_memory_mb,
    synthetic_batch,
    synthetic_images,
)

__all__ = ["PEAK_MEMORY_MEANS", "RuntimeModel", "StateCounter", "apply_plan", "check_world_size",
           "checkpoint_info", "init_distributed", "lm_loss", "load_checkpoint", "make_optimizer",
           "model_logits", "peak_memory_mb", "precision", "save_checkpoint", "shutdown",
           "synthetic_batch", "synthetic_images"]
