"""Torch-free IR of a traced model (see ``autopar.ir.graph`` for the conventions)."""

from autopar.ir.graph import (
    AttentionSpec,
    Block,
    Graph,
    MOE_GROUPED_MM,
    Node,
    OpKind,
    ParamSpec,
    SEQUENCE_DIM,
    TensorSpec,
    dtype_num_bytes,
    op_name,
)

__all__ = [
    "AttentionSpec",
    "Block",
    "Graph",
    "MOE_GROUPED_MM",
    "Node",
    "OpKind",
    "ParamSpec",
    "SEQUENCE_DIM",
    "TensorSpec",
    "dtype_num_bytes",
    "op_name",
]
