"""Small training helpers shared by generated scripts and their ``--reference`` mode:
synthetic causal-LM batches (and labelled images for image classifiers), the optimizer, and
the peak-memory reading."""

from __future__ import annotations

import resource
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["PEAK_MEMORY_MEANS", "make_optimizer", "peak_memory_mb", "synthetic_batch",
           "synthetic_images", "vocab_size"]

LEARNING_RATE = 1e-3  # fixed, so a sharded run and its reference take the same steps


def vocab_size(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "vocab_size"):
        return int(cfg.vocab_size)
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            return int(mod.num_embeddings)
    raise ValueError("cannot tell the vocabulary size: the model has no config.vocab_size and "
                     "no nn.Embedding; pass --loss for a non-token model")


def synthetic_batch(step: int, seed: int, batch: int, seq_len: int, vocab: int):
    """(inputs, labels) of shape [batch, seq_len]: seeded random tokens, labels shifted by one.
    Every rank draws the full global batch and keeps its own slice."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def synthetic_images(step: int, seed: int, batch: int, image_shape: tuple[int, ...],
                     num_classes: int):
    """(images, labels) for an image classifier: seeded N(0, 1) images ``[batch,
    *image_shape]`` (e.g. ``(3, 32, 32)``) and class labels ``[batch]`` in ``[0, num_classes)``.
    The default loss (``lm_loss``: cross entropy over the last dim of the logits) takes the
    classifier's ``[batch, num_classes]`` logits and these labels as they are.  Every rank
    draws the full global batch and keeps its own slice, as with ``synthetic_batch``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    images = torch.randn((batch, *image_shape), generator=gen)
    return images, torch.randint(0, num_classes, (batch,), generator=gen)


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float = LEARNING_RATE):
    """AdamW with a fixed learning rate, its multi-tensor (``foreach``) implementation: one
    kernel per update over all parameters of a group instead of a Python loop over them.  A
    foreach kernel takes tensors of one kind, so DTensor and plain-tensor parameters (e.g.
    expert weights next to sharded dense ones) go in separate, otherwise identical groups."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    kinds = [[p for p in params if isinstance(p, DTensor)],
             [p for p in params if not isinstance(p, DTensor)]]
    groups = [{"params": kind} for kind in kinds if kind]
    return torch.optim.AdamW(groups, lr=lr, foreach=True)


def _resident_bytes() -> int:
    """This process's resident set size now (Linux /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_START_RSS = _resident_bytes()  # torch and autopar loaded, no model yet
PEAK_MEMORY_MEANS = ("peak allocated" if torch.cuda.is_available()
                     else "growth of the peak resident set")


def peak_memory_mb() -> float:
    """Peak memory of this rank's tensors, in MiB: the allocator's peak allocated bytes on
    CUDA; on CPU the growth of the peak resident set over what the process held when this
    module was imported (torch loaded, no model), which also counts gloo's buffers and the
    CPU allocator's slack, so it reads somewhat above the tensors alone."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return max(0, peak - _START_RSS) / 2**20
