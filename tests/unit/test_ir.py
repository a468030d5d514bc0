"""The torch-free IR: specs, totals with repeated blocks, parameter counting, serialization."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from autopar.ir import Block, Graph, Node, OpKind, ParamSpec, TensorSpec, dtype_num_bytes

IR_DIR = pathlib.Path(__file__).resolve().parents[2] / "autopar" / "ir"


def test_ir_never_imports_torch():
    for path in IR_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path


def test_tensor_spec_bytes():
    assert TensorSpec(shape=(2, 3, 4), dtype="bfloat16").num_bytes == 48
    assert TensorSpec(shape=(), dtype="float32").numel == 1
    assert dtype_num_bytes("bool") == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_num_bytes("float12")


def _mm(name, path, layer, fqn, flops=10):
    w = ParamSpec(fqn=fqn, shape=(4, 4), dtype="float32")
    x = TensorSpec(shape=(2, 4), dtype="float32")
    return Node(name=name, kind=OpKind.MATMUL, target="aten.mm.default", inputs=(x,),
                input_sources=("input:0",), outputs=(x,), flops_fwd=flops, flops_bwd=2 * flops,
                params=(w,), saved_bytes=32, saved_bytes_recompute=32, module_path=path,
                layer_index=layer)


def _graph():
    nodes = (_mm("emb", "emb", None, "emb.weight", 1),
             _mm("l0", "layers.0", 0, "layers.0.weight"),
             _mm("head", "head", None, "emb.weight", 1))  # tied with emb
    block = Block(representative="layers.0", module_class="Layer",
                  layer_fqns=tuple(f"layers.{i}" for i in range(5)), layer_indices=tuple(range(5)),
                  node_names=("l0",))
    return Graph(nodes=nodes, blocks=(block,), inputs=(TensorSpec(shape=(2, 4), dtype="int64"),),
                 model_class="Toy", batch_size=2)


def test_totals_multiply_block_nodes_by_count():
    g = _graph()
    assert g.multiplicity("l0") == 5 and g.multiplicity("emb") == 1
    assert g.flops_fwd == 1 + 5 * 10 + 1
    assert g.flops_bwd == 2 * g.flops_fwd
    assert g.saved_bytes == 32 * 7
    assert g.block_of("l0").count == 5 and g.block_of("head") is None


def test_num_params_counts_tied_weights_once_and_blocks_per_copy():
    assert _graph().num_params == 16 + 5 * 16


def test_json_round_trip_and_fingerprint():
    g = _graph()
    text = json.dumps(g.to_dict())
    assert json.loads(text)["nodes"][0]["kind"] == "matmul"
    assert g.fingerprint() == _graph().fingerprint()
    changed = Graph(nodes=g.nodes[:2], blocks=g.blocks, inputs=g.inputs, model_class="Toy",
                    batch_size=2)
    assert changed.fingerprint() != g.fingerprint()


def test_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        TensorSpec((2,), "float32")  # positional
    spec = TensorSpec(shape=(2,), dtype="float32")
    with pytest.raises(AttributeError):
        spec.shape = (3,)


def test_summary_mentions_blocks():
    assert "layers.0 (Layer) x 5" in _graph().summary()
