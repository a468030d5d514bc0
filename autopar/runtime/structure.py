"""What the runtime reads from a model's module tree, by structure rather than by name.

A block list is a module container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``)
whose children are two or more modules of one class: the repeated layers of a transformer or a
ResNet stage, wherever the model keeps them (``layers``, ``transformer.h``, ``model.layers``,
``blocks``).  The search for them stops at the first such container on each path, so the experts
of an MoE layer inside a block are not taken for blocks.  On a pipeline stage the blocks it does
not run are stand-ins (``stands_in_for_block``), which count as blocks of any class.
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_names", "block_slots", "blocks"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    kinds = {type(c) for c in children if not getattr(c, "stands_in_for_block", False)}
    return isinstance(module, _CONTAINERS) and len(children) >= 2 and len(kinds) <= 1


def block_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(container, key)`` of every block of ``module``'s block lists, in module order."""
    return [(container, key) for container, key, _ in _find(module, "")]


def block_names(module: nn.Module) -> list[str]:
    """The module paths of the blocks of ``module``'s block lists, in module order."""
    return [name for _, _, name in _find(module, "")]


def _find(module: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    found: list[tuple[nn.Module, str, str]] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if _is_block_list(child):
            found += [(child, key, f"{path}.{key}") for key, _ in child.named_children()]
        else:
            found += _find(child, path + ".")
    return found


def blocks(module: nn.Module) -> list[nn.Module]:
    """Every block of ``module``'s block lists (see ``block_slots``)."""
    return [container.get_submodule(key) for container, key in block_slots(module)]
