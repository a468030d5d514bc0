"""Sharding rules: placements per tensor dim on one mesh axis, strategies per op kind.

* :mod:`.placement` -- ``"R"``, ``"S(d)"``, ``"P"`` and the collective that reshards one into
  another;
* :mod:`.strategy` -- a strategy of one op on one axis, and the N-D product over mesh axes;
* :mod:`.einsum` -- matmul-family strategies generated from einsum equations;
* :mod:`.views` -- how shards pass through views, from shapes alone;
* :mod:`.rules` -- the rule table by ``OpKind``;
* :mod:`.problem` -- one block's sharding problem as plain tables (costs, memory, tensors),
  read by the intra-op ILP (:mod:`autopar.search.intra_op`) and by brute-force oracles.

The ILP solves the tensor-parallel axis; the rules are written for any one axis and
``expand_nd`` forms N-D strategies for a later sequence/second axis.
"""

from autopar.sharding.placement import PARTIAL, REPLICATE, reshard_collective, shard
from autopar.sharding.rules import strategies
from autopar.sharding.strategy import NDStrategy, Strategy, expand_nd

__all__ = ["PARTIAL", "REPLICATE", "NDStrategy", "Strategy", "expand_nd", "reshard_collective",
           "shard", "strategies"]
