"""``blocks="auto"``: every repeated unit of a model, across its stages, in model order.

A unit is an instance of a module class that occurs at least twice, has parameters and submodules
of its own, and is not a plain container (ModuleList, ModuleDict, or a Sequential without its own
forward). Hierarchical models change width from stage to stage, so units of one class may differ in
shape (ResNet's first block of a stage downsamples); they are one kind all the same.

Several classes usually qualify: a transformer layer and the attention inside it, a MobileNet
inverted residual and the squeeze-excitation inside it, a stage and the blocks inside it. Class C
gives way to class D when most instances of C lie inside instances of D: checkpointing D covers C,
with fewer boundaries to keep. The exception is a D that is a stage of C, holding a run of two or
more same-shape C in a row (ConvNeXt or timm ResNet stages, or timm RegNet's stages, which hold their
blocks as numbered attributes b1, b2, ...): there the finer C is the unit. Of the classes left, the
one with most instances wins (then more parameters, then first found).

A stage list may open with a block of another class: timm's EfficientNet starts with a depthwise
separable block in blocks.0, the inverted residuals follow in blocks.1 onwards. Such a block is
the highest-resolution one, which keeps the most bytes, so it joins: any unit-like module (own
parameters and submodules, not a container) beside the winning units in their container, or in a
sibling container of theirs in the stage list, that neither holds nor lies in a unit.

Models whose only repeats are single layers (a stack of nn.Linear) fall back to the longest run of
same-class, same-shape siblings in one ModuleList / Sequential.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from ..errors import CheckpointError
from ..trees.modules import is_inside

__all__ = ["auto_blocks", "describe_blocks"]


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _is_container(module: nn.Module) -> bool:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return True
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _units_by_class(model: nn.Module) -> dict[type, list[tuple[str, nn.Module]]]:
    """Candidate classes -> their outermost instances (none inside another of the same class)."""
    found: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, module in model.named_modules():
        if not name or _is_container(module) or not any(True for _ in module.children()):
            continue
        if _num_parameters(module) == 0:
            continue
        same = found[type(module)]
        if any(is_inside(name, outer) for outer, _ in same):
            continue
        same.append((name, module))
    return {cls: units for cls, units in found.items() if len(units) >= 2}


def _series_name(name: str) -> str | None:
    """'b1' -> 'b': the stem of a numbered attribute, None for a name without a trailing number."""
    stem = name.rstrip("0123456789")
    return stem if stem != name else None


def _holds_run_of(outer: nn.Module, cls: type) -> bool:
    """True when a module inside ``outer`` holds two or more same-shape ``cls`` in a row: children of
    a ModuleList / Sequential, or attributes of one numbered series (b1, b2, ... as timm's RegStage)."""
    for container in outer.modules():
        listed = isinstance(container, (nn.ModuleList, nn.Sequential))
        previous = None
        for name, child in container.named_children():
            series = "" if listed else _series_name(name)
            signature = (series, _signature(child)) if type(child) is cls and series is not None else None
            if signature is not None and signature == previous:
                return True
            previous = signature
    return False


def _gives_way(inner: list[tuple[str, nn.Module]], cls: type, outer: list[tuple[str, nn.Module]]) -> bool:
    enclosed = sum(any(is_inside(name, o) for o, _ in outer) for name, _ in inner)
    if 2 * enclosed <= len(inner):
        return False
    return not any(_holds_run_of(module, cls) for _, module in outer)


def _longest_run(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Largest run of consecutive same-class, same-shape children of any ModuleList / Sequential."""
    best: list[tuple[str, nn.Module]] = []
    best_key = (1, 0)
    for container_name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        start = 0
        while start < len(children):
            signature = _signature(children[start][1])
            stop = start + 1
            while stop < len(children) and _signature(children[stop][1]) == signature:
                stop += 1
            run = children[start:stop]
            start = stop
            num_params = sum(_num_parameters(module) for _, module in run)
            key = (len(run), num_params)
            if len(run) >= 2 and num_params > 0 and key > best_key:
                prefix = f"{container_name}." if container_name else ""
                best, best_key = [(prefix + name, module) for name, module in run], key
    return best


def _is_unit_like(module: nn.Module) -> bool:
    return not _is_container(module) and any(True for _ in module.children()) and _num_parameters(module) > 0


def _with_leading_blocks(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``units`` and the unit-like modules beside them (see the module docstring), in model order."""
    modules = dict(model.named_modules())

    def parent(name: str) -> str:
        return name.rpartition(".")[0]

    homes = {parent(name) for name, _ in units if name}
    containers = {home for home in homes if _is_container(modules[home])}
    stage_lists = {parent(home) for home in containers if home and _is_container(modules[parent(home)])}
    for stage_list in stage_lists:
        prefix = f"{stage_list}." if stage_list else ""
        containers |= {
            prefix + n for n, child in modules[stage_list].named_children() if _is_container(child)
        }
    chosen = [name for name, _ in units]
    extra = [
        f"{home}.{name}" if home else name
        for home in containers
        for name, child in modules[home].named_children()
        if _is_unit_like(child)
    ]
    extra = [
        name
        for name in extra
        if name not in chosen and not any(is_inside(name, unit) or is_inside(unit, name) for unit in chosen)
    ]
    if not extra:
        return units
    order = {name: index for index, name in enumerate(modules)}
    return sorted([*units, *((name, modules[name]) for name in extra)], key=lambda item: order[item[0]])


def auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``blocks="auto"`` selects (see the module docstring), in model order."""
    units = _units_by_class(model)
    kept = [
        cls
        for cls, instances in units.items()
        if not any(_gives_way(instances, cls, units[other]) for other in units if other is not cls)
    ]
    if kept:
        order = {cls: index for index, cls in enumerate(units)}
        best = max(
            kept,
            key=lambda cls: (
                len(units[cls]),
                sum(_num_parameters(m) for _, m in units[cls]),
                -order[cls],
            ),
        )
        return _with_leading_blocks(model, list(units[best]))
    run = _longest_run(model)
    if run:
        return run
    raise CheckpointError(
        f"blocks='auto' found no repeated blocks in {type(model).__name__}: no module class with "
        "parameters occurs twice, and no nn.ModuleList or nn.Sequential holds two or more consecutive "
        "modules of the same class and parameter shapes. Name the blocks instead, e.g. "
        "blocks=['encoder.0', 'encoder.1'] (see model.named_modules()), or pass a predicate such as "
        "blocks=lambda name, module: isinstance(module, MyBlock)"
    )


def describe_blocks(blocks: list[tuple[str, nn.Module]]) -> str:
    """'16 Bottleneck blocks (layer1.0 .. layer4.2)': what auto picked, in one line."""
    classes = sorted({type(module).__name__ for _, module in blocks})
    first, last = blocks[0][0], blocks[-1][0]
    where = first if len(blocks) == 1 else f"{first} .. {last}"
    return f"{len(blocks)} {'/'.join(classes)} blocks ({where})"
