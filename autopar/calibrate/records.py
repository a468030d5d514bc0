"""What `autopar calibrate` measured: plain records, no torch, so the fit can be tested on
synthetic data and a run can be written out and read back.

Times are seconds. A collective's `nbytes` is the whole buffer as nccl-tests counts it (the
gathered size for all_gather, the input for reduce_scatter), and its time is the median over
rounds of the slowest rank's mean over back-to-back calls. `held_out` marks the sizes the fit
does not see; the table reports their error apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from costmodels.memory import DTYPE_BYTES

__all__ = ["CollectivePoint", "GemmPoint", "CopyPoint", "AttentionPoint", "Measurements",
           "size_grid", "held_out_sizes", "median_rse"]

# a GEMM's operands by the precision it runs at: TF32 math reads and writes fp32 tensors
_OPERAND_BYTES = {**DTYPE_BYTES, "tf32": DTYPE_BYTES["fp32"]}


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectivePoint:
    kind: str  # a costmodels.collectives.Collective value
    group: str  # "intra" (one node), "inter" (one rank per node) or "world"
    ranks: tuple[int, ...]  # the measured group that holds rank 0 (its layout is what is costed)
    nbytes: int
    time_s: float
    held_out: bool = False
    # relative standard error of time_s, the median over rounds: 0.93 x interquartile range
    # / (median x sqrt(rounds)); how far a repeat of the measurement may land
    rse: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmPoint:
    dtype: str
    m: int
    k: int
    n: int
    time_s: float  # one (m x k) @ (k x n) matmul, median over repetitions and ranks

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def nbytes(self) -> float:
        """Bytes a GEMM moves at least: both operands read, the output written."""
        return float(_OPERAND_BYTES[self.dtype] * (self.m * self.k + self.k * self.n
                                                  + self.m * self.n))


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyPoint:
    nbytes: int  # bytes copied; the memory moves twice that (read + write)
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionPoint:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool
    time_s: float  # forward of scaled_dot_product_attention in bf16 (flash kernel)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """One calibration run: where it ran and everything it timed."""

    date: str  # YYYY-MM-DD
    num_nodes: int
    ranks_per_node: int
    backend: str  # "gloo" or "nccl"
    device_name: str
    torch_version: str
    quick: bool
    collectives: tuple[CollectivePoint, ...] = ()
    gemms: tuple[GemmPoint, ...] = ()
    copies: tuple[CopyPoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    memory_bytes: float | None = None  # usable memory of one device (one rank's share on CPU)
    memory_how: str = ""  # how memory_bytes was found
    op_overhead_s: float | None = None  # eager cost of one tiny op (CPU only)
    notes: tuple[str, ...] = field(default_factory=tuple)  # what was skipped, and why


def size_grid(max_bytes: int, step: int) -> list[int]:
    """Buffer sizes 8 B, 8·step B, ... up to `max_bytes` (kept on the grid's last point)."""
    if step < 2:
        raise ValueError(f"size grid step must be >= 2, got {step}")
    sizes, size = [], 8
    while size <= max_bytes:
        sizes.append(size)
        size *= step
    return sizes


def held_out_sizes(sizes: list[int]) -> set[int]:
    """Every other interior size of the grid: the fit sees the smallest, the largest and the
    sizes between the held-out ones, so every held-out size lies inside what was fitted."""
    return set(sorted(sizes)[1:-1:2])


def median_rse(samples: list[float]) -> float:
    """Relative standard error of the median of `samples`: 1.2533 x sigma / sqrt(n), sigma
    estimated robustly as IQR / 1.349, over the median (0 for fewer than 4 samples)."""
    if len(samples) < 4:
        return 0.0
    ordered = sorted(samples)
    n = len(ordered)

    def quantile(q: float) -> float:
        pos = q * (n - 1)
        low = int(pos)
        high = min(low + 1, n - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    median = quantile(0.5)
    if median <= 0:
        return 0.0
    return 1.2533 * (quantile(0.75) - quantile(0.25)) / 1.349 / n ** 0.5 / median
