"""Modules that stand in, on a pipeline stage, for the parts of the model the stage does not run
(`autopar.runtime.pipeline`): a block it does not own passes its hidden input on, a module
outside the blocks whose parameters it does not own returns zeros shaped like its output.  Both
keep what the model's own forward may read off the module they replace."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["PassBlock", "ZeroOutput", "hidden_arg"]


def hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    """A block's hidden-state input: its first positional argument, else its first
    floating-point keyword argument."""
    if args:
        return args[0]
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise ValueError("a block was called without a hidden-state tensor argument")


def _keep_attributes(stand_in: nn.Module, module: nn.Module) -> None:
    """Give the module standing in for ``module`` what a model's forward may read off it:
    its plain attributes, its own parameters and buffers as expanded zero buffers (no memory;
    Llama 4 reads ``embed_tokens.weight.device``), and its sub-modules as `_hollow` copies,
    which no module walk sees (``nn.TransformerEncoder`` reads
    ``layers[0].self_attn.batch_first``)."""
    for name, value in vars(module).items():
        if not name.startswith("_") and name != "training":
            setattr(stand_in, name, value)
    for name, t in (*module.named_parameters(recurse=False),
                    *module.named_buffers(recurse=False)):
        stand_in.register_buffer(name, _zeros(t), persistent=False)
    for name, child in module.named_children():
        object.__setattr__(stand_in, name, _hollow(child))


def _zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def _hollow(module: nn.Module) -> Any:
    """``module``'s attribute tree without its work: plain attributes, parameters and buffers
    as expanded zeros, sub-modules likewise (a module list as a list)."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return [_hollow(child) for child in module]
    if isinstance(module, nn.ModuleDict):
        return {name: _hollow(child) for name, child in module.items()}
    tree = SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("_")})
    for name, t in (*module.named_parameters(recurse=False),
                    *module.named_buffers(recurse=False)):
        setattr(tree, name, _zeros(t))
    for name, child in module.named_children():
        setattr(tree, name, _hollow(child))
    return tree


class PassBlock(nn.Module):
    """Stands in for a block this stage does not own: returns its hidden input, in the block's
    output structure (a tensor, or a tuple holding it at ``index``). It keeps what a model's
    forward may read off its blocks (`_keep_attributes`; Hugging Face's
    ``layer.attention_type`` picks each layer's mask)."""

    stands_in_for_block = True  # structure.block_slots: still a slot of the block list

    def __init__(self, index: int | None, block: nn.Module):
        super().__init__()
        _keep_attributes(self, block)
        self._hidden_index = index

    def forward(self, *args, **kwargs):
        hidden = hidden_arg(args, kwargs)
        index = self._hidden_index
        if index is None:
            return hidden
        return tuple(hidden if i == index else None for i in range(index + 1))


class ZeroOutput(nn.Module):
    """Stands in for a module outside the blocks whose parameters this stage does not own:
    returns zeros shaped like its output in the probe, as expanded scalars. It keeps what a
    forward may read off the module (`_keep_attributes`)."""

    def __init__(self, spec: Any, module: nn.Module):
        super().__init__()
        _keep_attributes(self, module)
        self.spec = spec

    def forward(self, *args, **kwargs):
        device = next((t.device for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor)), torch.device("cpu"))
        return tree_map(lambda s: torch.zeros((), dtype=s[1], device=device).expand(s[0])
                        if _is_spec(s) else s, self.spec, is_leaf=_is_spec)


def _is_spec(s: Any) -> bool:
    """A tensor's ``(shape, dtype)`` in an output the pipeline's probe recorded."""
    return isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], torch.dtype)
