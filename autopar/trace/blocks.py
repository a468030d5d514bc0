"""Repeated-block detection and the shallow "one of each" copy of a model that gets traced.

A *stack* is a module container (``ModuleList``, ``Sequential``, ``ModuleDict``, or the root
if it is one) some of whose children are structurally identical: same classes, parameter
and buffer shapes and dtypes, and plain configuration attributes (ints, floats, strings,
bools; attributes that hold a layer number, like ``layer_idx``, are ignored). Children with
equal signatures form one group; only the first child of each group is traced and the group
becomes one ``ir.Block`` with a count. A container whose children all pass a column-wise
comparison (`_columns_alike`, the usual deep stack of identical layers) is one group without
a signature per child.

``shrink`` builds the traced model without touching the user's: the root, the modules on the
way to each stack and the stacks themselves are shallow copies whose child tables keep only
the representatives under their original keys, so every name (``layers.0.attention.wq``)
is the user's fully qualified name. Everything else is shared with the user's model.
"""

from __future__ import annotations

import collections
import copy
import enum
import functools
from dataclasses import dataclass

import torch.nn as nn

__all__ = ["Stack", "all_alike", "find_stacks", "shrink", "signature"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _config_value(val):
    kind = type(val)
    if kind in _PLAIN:
        return val
    if kind is tuple:  # e.g. conv stride
        return val if _PLAIN.issuperset(map(type, val)) else _SKIP
    if isinstance(val, enum.Enum):
        return val
    if hasattr(kind, "__dataclass_fields__"):
        return repr(val)
    return _SKIP


_SKIP = object()
# attributes every nn.Module has
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


_CONFIG_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _config_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The configuration attributes among a module's instance attributes, sorted: public
    ones other than the training flag and layer numbers (``layer_idx``). Modules of one class
    share their attribute names, so this runs once per class, not once per layer."""
    found = _CONFIG_KEYS.get(keys)
    if found is None:
        found = _CONFIG_KEYS[keys] = tuple(sorted(
            k for k in keys if k[0] != "_" and k not in _MODULE_INTERNALS
            and k not in {"layer_id", "layer_number"} and "idx" not in k and "index" not in k))
    return found


def signature(module: nn.Module) -> tuple:
    """A hashable structural signature; equal signatures mean interchangeable blocks.

    Per submodule, in depth-first order: depth, key, class, the names of its config
    attributes (those `_config_value` does not skip), their values, its parameters as (name,
    shape, dtype, ``requires_grad``) runs and its buffers as (name, shape, dtype) runs, each
    list closed by None. One flat tuple rather than a tuple per submodule, because it runs
    once per layer of the user's model and must stay cheap next to tracing one block. It
    reads back in one way only (the names say how many values follow, and no name is None),
    so equal tuples mean equal modules.
    """
    out: list = []
    add = out.append
    plain = _PLAIN

    def visit(depth: int, key: str, m: nn.Module) -> None:
        d = m.__dict__
        config = _config_keys(tuple(d))
        add(depth)
        add(key)
        add(type(m))
        at = len(out)
        add(config)
        for k in config:
            v = d[k]
            if type(v) not in plain:
                v = _config_value(v)
                if v is _SKIP:  # rare: name the attributes kept instead
                    out[at] = tuple(k for k in config if _config_value(d[k]) is not _SKIP)
                    continue
            add(v)
        params = d["_parameters"]
        if params:
            for k, p in params.items():
                if p is not None:
                    add(k)
                    add(p.shape)
                    add(p.dtype)
                    add(p.requires_grad)
        add(None)
        bufs = d["_buffers"]
        if bufs:
            for k, b in bufs.items():
                if b is not None:
                    add(k)
                    add(b.shape)
                    add(b.dtype)
        add(None)
        for k, child in d["_modules"].items():
            if child is not None:
                visit(depth + 1, k, child)

    visit(0, "", module)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Stack:
    """A container with repeated children: its FQN, child keys, and groups of equal keys."""

    fqn: str
    keys: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]  # keys with equal signatures, in first-seen order
    first_layer_index: int

    def child_fqn(self, key: str) -> str:
        return f"{self.fqn}.{key}" if self.fqn else key

    def layer_index(self, key: str) -> int:
        return self.first_layer_index + self._positions[key]

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        return {key: k for k, key in enumerate(self.keys)}


def _same(column: list) -> bool:
    return column.count(column[0]) == len(column)


def _columns_alike(modules: list[nn.Module]) -> bool:
    """True only if every module has the first one's `signature`; False if not or if unsure.

    Compares one attribute at a time across all the modules (a column per class, config
    value, parameter or buffer field and child key, recursing into the children key by key)
    instead of building a signature per module: a column is a list comprehension and one
    ``list.count``, so a deep stack of identical layers costs a fraction of its signatures.
    It asks for more than `signature` does -- the same instance attribute names in the same
    order, no None child -- so modules it is unsure of are grouped by `signature`."""
    if not _same([type(m) for m in modules]):
        return False
    try:
        dicts = [m.__dict__ for m in modules]
    except AttributeError:  # a None child
        return False
    names = [tuple(d) for d in dicts]
    if not _same(names):
        return False
    for k in _config_keys(names[0]):
        values = [d[k] for d in dicts]
        if not _PLAIN.issuperset(map(type, values)):
            values = [_config_value(v) for v in values]
        if not _same(values):
            return False
    for table in ("_parameters", "_buffers"):
        tables = [d[table] for d in dicts]
        if not _same([tuple(t) for t in tables]):
            return False
        for k in tables[0]:
            tensors = [t[k] for t in tables]
            try:
                shapes = [t.shape for t in tensors]
            except AttributeError:  # None entries, which `signature` leaves out
                if all(t is None for t in tensors):
                    continue
                return False
            if not (_same(shapes) and _same([t.dtype for t in tensors])):
                return False
            if table == "_parameters" and not _same([t.requires_grad for t in tensors]):
                return False
    children = [d["_modules"] for d in dicts]
    if not _same([tuple(c) for c in children]):
        return False
    return all(_columns_alike([c[k] for c in children]) for k in children[0])


def all_alike(modules: list[nn.Module]) -> bool:
    """Whether all of `modules` (at least one) share one `signature`."""
    return _columns_alike(modules) or len({signature(m) for m in modules}) == 1


def _stack_of(fqn: str, container: nn.Module, first_index: int) -> Stack | None:
    children = container._modules
    if len(children) < 2:
        return None
    if _columns_alike(list(children.values())):
        return Stack(fqn=fqn, keys=tuple(children), groups=(tuple(children),),
                     first_layer_index=first_index)
    by_sig: dict[tuple, list[str]] = collections.OrderedDict()
    for key, child in children.items():
        if child is None:
            continue
        by_sig.setdefault(signature(child), []).append(key)
    if len(by_sig) == len(children):
        return None
    return Stack(fqn=fqn, keys=tuple(children), groups=tuple(tuple(k) for k in by_sig.values()),
                 first_layer_index=first_index)


def find_stacks(model: nn.Module) -> list[Stack]:
    """Top-most containers with repeated children, in module order (not inside each other)."""
    stacks: list[Stack] = []
    next_index = 0

    def visit(fqn: str, module: nn.Module) -> None:
        nonlocal next_index
        if isinstance(module, _CONTAINERS):
            stack = _stack_of(fqn, module, next_index)
            if stack is not None:
                stacks.append(stack)
                next_index += len(stack.keys)
                return
        for name, child in module._modules.items():
            if child is not None:
                visit(f"{fqn}.{name}" if fqn else name, child)

    visit("", model)
    return stacks


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing parameters and children, with its own child and hook tables."""
    clone = copy.copy(module)
    for key, val in vars(module).items():
        if isinstance(val, dict) and (key in ("_modules", "_parameters", "_buffers")
                                      or key.startswith(("_forward", "_backward"))):
            clone.__dict__[key] = type(val)(val)
    return clone


def shrink(model: nn.Module, stacks: list[Stack], keep_all: frozenset[str] = frozenset()
           ) -> nn.Module:
    """The model with only group representatives left in each stack (see module doc).

    Stacks whose FQN is in ``keep_all`` keep every child (they are traced in full).
    """
    root = _shallow(model)
    for stack in stacks:
        if stack.fqn in keep_all:
            continue
        container = root
        if stack.fqn:
            for part in stack.fqn.split("."):
                child = _shallow(container._modules[part])
                container._modules[part] = child
                container = child
        reps = {group[0] for group in stack.groups}
        container._modules = collections.OrderedDict(
            (k, m) for k, m in container._modules.items() if k in reps)
    return root
