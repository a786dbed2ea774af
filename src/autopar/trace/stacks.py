"""Find a model's repeated layers (its *stacks*) from the module tree, by structure.

A pipeline cut falls between layers, so the tracer must know which modules are the layers.
Users hold them in many ways, and all of them count:

- an nn.ModuleList (any length, its children in any mix of classes: attention and mixer
  blocks may alternate), or an nn.Sequential of two or more modules, as written;
- an nn.ModuleDict or plain attributes of one module (`self.h0 .. self.h3`): the children
  that repeat, that is two or more modules made of modules (not bare nn.Linear or norms) of
  one class with the same parameter names and shapes. A ModuleDict whose entries all repeat
  is one stack even when two block classes alternate; one of unlike entries (the
  `transformer = ModuleDict(wte=..., h=ModuleList(...), ln_f=...)` of many GPTs) is no stack,
  the ModuleList inside it is.

Of all candidates, the one holding the most parameters is chosen: the outermost stack, since
a stack holds every parameter of a stack inside it (so a block's inner MLP Sequential never
wins over the blocks). When every layer of the chosen stack is itself mostly (three quarters
of its parameters) a stack of repeated blocks, as with two identical towers each holding its
layers, those inner stacks are chosen instead, which cuts finer. Then any other stack of
one class of layers, outside the chosen ones and at least half the largest's size, joins
them: the encoder and decoder layers of a T5 or BART. Parameters decide, not names.

Order: `find_stacks` lists members in registration order; `trace()` renumbers them in
the order the forward first runs them (the traced graph's module stack), which is the
order attribute-held blocks are called in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)  # hold modules, never called
LOOK_THROUGH_SHARE = 0.75  # a layer that is this much a stack of repeated blocks is cut inside
SECOND_STACK_SHARE = 0.5  # another stack of like layers this large (against the largest) is cut too


@dataclass(frozen=True)
class Stack:
    """Repeated layers: children of the module at `path`, run one after another."""

    path: str  # the module holding them ("": the model itself)
    kind: str  # "ModuleList", "Sequential", "ModuleDict" or "attributes"
    members: tuple[str, ...]  # child names (forward order once traced)
    classes: tuple[str, ...]  # each member's class name

    def member_path(self, i: int) -> str:
        """The layer's FQN: the block name a pipeline stage lists (`layers.3`, `h0`)."""
        return f"{self.path}.{self.members[i]}" if self.path else self.members[i]

    @property
    def member_paths(self) -> tuple[str, ...]:
        return tuple(self.member_path(i) for i in range(len(self.members)))

    def describe(self) -> str:
        """For plans and banners: `transformer.h (ModuleDict, 4 x Block)`, `h0 .. h3 (attributes, 4 x Block)`."""
        counts = " + ".join(f"{n} x {cls}" for cls, n in Counter(self.classes).items())
        if self.kind == "attributes":
            paths = self.member_paths
            where = f"{paths[0]} .. {paths[-1]}" if len(paths) > 2 else ", ".join(paths)
            return f"{where} (attributes of {self.path or 'the model'}, {counts})"
        return f"{self.path or 'the model'} ({self.kind}, {counts})"

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "layers": list(self.member_paths), "classes": list(self.classes)}


def _signature(module: nn.Module) -> tuple:
    """What makes two modules the same layer: class, parameter names and shapes."""
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _is_block(module: nn.Module) -> bool:
    """A module made of modules that is called (not a bare Linear or norm, not a ModuleList)."""
    return not isinstance(module, _CONTAINERS) and next(module.children(), None) is not None


def _repeated_groups(path: str, module: nn.Module) -> list[Stack]:
    """The children of `module` that repeat: two or more blocks of one signature, one Stack per signature.

    A ModuleDict whose every entry repeats is one stack, in key order, like a ModuleList whose
    block classes alternate."""
    groups: dict[tuple, list[tuple[str, nn.Module]]] = {}
    for name, child in module.named_children():
        if _is_block(child):
            groups.setdefault(_signature(child), []).append((name, child))
    repeated = [group for group in groups.values() if len(group) >= 2]
    if isinstance(module, nn.ModuleDict):
        if sum(len(group) for group in repeated) == len(module):
            return [Stack(path, "ModuleDict", tuple(module.keys()), tuple(type(c).__name__ for c in module.values()))]
        return [Stack(path, "ModuleDict", tuple(n for n, _ in group), tuple(type(c).__name__ for _, c in group))
                for group in repeated]
    return [Stack(path, "attributes", tuple(n for n, _ in group), tuple(type(c).__name__ for _, c in group))
            for group in repeated]


def candidate_stacks(model: nn.Module) -> list[Stack]:
    """Every container or group of repeated layers in the model, outer before inner."""
    found = []
    for path, module in model.named_modules():
        as_written = isinstance(module, nn.ModuleList) or isinstance(module, nn.Sequential) and len(module) >= 2
        if as_written and len(module) >= 1:
            kind = "ModuleList" if isinstance(module, nn.ModuleList) else "Sequential"
            names = tuple(name for name, _ in module.named_children())
            found.append(Stack(path, kind, names, tuple(type(c).__name__ for c in module.children())))
        else:
            found.extend(_repeated_groups(path, module))
    return found


class _Sizes:
    """Parameter elements held by a stack's layers, each tensor counted once (a tied weight too)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def of_paths(self, paths: tuple[str, ...]) -> int:
        seen = {}
        for path in paths:
            for p in self.model.get_submodule(path).parameters():
                seen[id(p)] = p.numel()
        return sum(seen.values())

    def of(self, stack: Stack) -> int:
        return self.of_paths(stack.member_paths)


def _inside(path: str, outer: str) -> bool:
    return path == outer or outer == "" or path.startswith(outer + ".")


def _overlap(a: Stack, b: Stack) -> bool:
    """One stack's layers lie in (or hold) the other's."""
    return any(_inside(x, y) or _inside(y, x) for x in a.member_paths for y in b.member_paths)


def _look_through(stack: Stack, candidates: list[Stack], sizes: _Sizes) -> list[Stack]:
    """The stacks inside each layer of `stack`, when every layer is mostly one stack of repeated blocks."""
    inner = []
    for layer in stack.member_paths:
        repeated = [c for c in candidates if all(_inside(p, layer) and p != layer for p in c.member_paths)
                    and len(c.members) >= 2 and _all_alike(c, sizes.model)]
        if not repeated:
            return [stack]
        best = max(repeated, key=sizes.of)  # max keeps the first (outermost) of equals
        if sizes.of(best) < LOOK_THROUGH_SHARE * sizes.of_paths((layer,)):
            return [stack]
        inner.extend(_look_through(best, candidates, sizes))
    return inner


def _all_alike(stack: Stack, model: nn.Module) -> bool:
    """Every layer a block of one signature (not a Sequential of Linear, GELU, Linear)."""
    layers = [model.get_submodule(p) for p in stack.member_paths]
    return all(_is_block(m) for m in layers) and len({_signature(m) for m in layers}) == 1


def find_stacks(model: nn.Module) -> list[Stack]:
    """The model's stacks of repeated layers (members in registration order; see the module docstring).

    Empty when the model has no stack: it is then one block (tensor parallelism needs no cut)."""
    candidates = candidate_stacks(model)
    if not candidates:
        return []
    sizes = _Sizes(model)
    size = [sizes.of(c) for c in candidates]
    largest = candidates[max(range(len(candidates)), key=lambda i: (size[i], -i))]
    chosen = _look_through(largest, candidates, sizes)
    floor = SECOND_STACK_SHARE * max(sizes.of(c) for c in chosen)
    for candidate, count in zip(candidates, size):
        alike = len(set(candidate.classes)) == 1
        if alike and count >= floor and not any(_overlap(candidate, c) for c in chosen):
            chosen.append(candidate)
    return [c for c in candidates if c in chosen]  # outer before inner; trace() puts them in forward order


def find_layers(model: nn.Module) -> str | None:
    """The FQN of the module holding the model's first stack ("" the model itself; None: no stack)."""
    stacks = find_stacks(model)
    return stacks[0].path if stacks else None


def in_order(stack: Stack, order: list[int]) -> Stack:
    """`stack` with its members in the given order (the order the forward ran them)."""
    return replace(stack, members=tuple(stack.members[i] for i in order),
                   classes=tuple(stack.classes[i] for i in order))
