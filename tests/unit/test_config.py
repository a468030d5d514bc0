"""ParallelConfig and check_config: what is rejected, and that the message says what works."""

import pytest

from autopar import ParallelConfig
from autopar.config import check_config, divisors


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=0), "dp must be an integer >= 1"),
    (dict(tp=2.0), "tp must be an integer >= 1"),
    (dict(zero_stage=4), "zero_stage must be 0 .DDP., 1, 2 or 3"),
    (dict(pp_schedule="1F1B"), "pp_schedule '1F1B' is unknown; allowed: gpipe, 1f1b"),
    (dict(recompute="some"), "recompute 'some' is unknown; allowed: none, selective, per_op, full"),
    (dict(virtual_stages=2), "virtual_stages=2 needs pp_schedule='interleaved-1f1b'"),
])
def test_invalid_fields_are_rejected_with_the_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_check_config_returns_micro_batches_and_explains_mismatches():
    cfg = ParallelConfig(dp=8, tp=8, pp=2, micro_batch_size=2, pp_schedule="interleaved-1f1b",
                         virtual_stages=2)
    assert check_config(cfg, world_size=128, global_batch_size=512, num_layers=32,
                        num_heads=32) == 32
    with pytest.raises(ValueError, match="cluster has 64 GPUs; dp=4 would match"):
        check_config(cfg, world_size=64, global_batch_size=512, num_layers=32)
    with pytest.raises(ValueError, match="micro_batch_size could be one of"):
        check_config(cfg, world_size=128, global_batch_size=520, num_layers=32)
    with pytest.raises(ValueError, match=r"tp=8 must divide the 12 attention heads; allowed tp: \[1, 2, 4\]"):
        check_config(cfg, world_size=128, global_batch_size=512, num_layers=32, num_heads=12)
    with pytest.raises(ValueError, match="4 stages for 3 layers"):
        check_config(cfg, world_size=128, global_batch_size=512, num_layers=3)
    with pytest.raises(ValueError, match="multiple of pp=2"):
        check_config(ParallelConfig(dp=8, tp=8, pp=2, pp_schedule="interleaved-1f1b",
                                    virtual_stages=2, micro_batch_size=3),
                     world_size=128, global_batch_size=24 * 3, num_layers=32)
    with pytest.raises(ValueError, match="cp=2 needs seq_len divisible by 2\\*cp = 4"):
        check_config(ParallelConfig(dp=4, cp=2), world_size=8, global_batch_size=8,
                     num_layers=4, seq_len=6)


def test_short_label():
    cfg = ParallelConfig(dp=8, tp=8, pp=16, zero_stage=1, pp_schedule="interleaved-1f1b",
                         virtual_stages=2, sequence_parallel=True, recompute="selective")
    assert cfg.short() == "dp8 tp8 pp16 z1 mb1 interleaved-1f1bx2 sp rc=selective"
    assert cfg.world_size == 1024


def test_divisors_equal_trial_division():
    for n in list(range(1, 1200)) + [4096, 16384, 3 * 5 * 7 * 11 * 13, 317 ** 2]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_a_config_that_cannot_run_raises_invalid_config_error():
    """What the search skips a configuration for is its own class (a ValueError, so callers
    catching ValueError still do): an unrelated ValueError is never taken for one."""
    from autopar import InvalidConfigError
    from autopar.config import check_config

    cfg = ParallelConfig(dp=2, tp=3)
    with pytest.raises(InvalidConfigError, match="tp=3 must divide the 8 attention heads"):
        check_config(cfg, world_size=6, global_batch_size=8, num_layers=4, num_heads=8)
    assert issubclass(InvalidConfigError, ValueError)
