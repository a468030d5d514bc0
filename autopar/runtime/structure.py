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

__all__ = ["block_slots", "blocks"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _is_block_list(module: nn.Module) -> bool:
    children = list(module.children())
    kinds = {type(c) for c in children if not getattr(c, "stands_in_for_block", False)}
    return isinstance(module, _CONTAINERS) and len(children) >= 2 and len(kinds) <= 1


def block_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(container, key)`` of every block of ``module``'s block lists, in module order."""
    found: list[tuple[nn.Module, str]] = []
    for child in module.children():
        if _is_block_list(child):
            found += [(child, key) for key, _ in child.named_children()]
        else:
            found += block_slots(child)
    return found


def blocks(module: nn.Module) -> list[nn.Module]:
    """Every block of ``module``'s block lists (see ``block_slots``)."""
    return [container.get_submodule(key) for container, key in block_slots(module)]
