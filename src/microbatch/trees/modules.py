"""Walking a model's module tree: one place for the walks the library repeats.

Module names are those of ``model.named_modules()``: "" is the model itself, "a.b" the submodule
``b`` of ``a``. A name lies inside another when it extends it by one or more ".part"s.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["ancestors", "is_inside", "modules_of_type", "replace_modules"]


def modules_of_type(
    model: nn.Module, types: type[nn.Module] | tuple[type[nn.Module], ...]
) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module of ``model`` (itself included) that is an instance of ``types``,
    in model order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, types)]


def is_inside(name: str, outer: str) -> bool:
    """True when module ``name`` lies strictly inside module ``outer`` ("" is the model itself)."""
    if name == outer:
        return False
    return outer == "" or name.startswith(outer + ".")


def ancestors(name: str) -> list[str]:
    """The names of the modules enclosing ``name``, outermost ("", the model) first."""
    if not name:
        return []
    parts = name.split(".")
    return [".".join(parts[:depth]) for depth in range(len(parts))]


def replace_modules(
    model: nn.Module,
    select: Callable[[nn.Module], bool],
    replace: Callable[[nn.Module], nn.Module],
) -> list[str]:
    """Replace, in place, every submodule that ``select`` picks by ``replace(submodule)``.

    The walk does not descend into a picked submodule (its replacement is not walked either), and
    ``model`` itself is never replaced. Returns the names replaced, in model order.
    """
    replaced: list[str] = []

    def walk(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}{child_name}"
            if select(child):
                setattr(parent, child_name, replace(child))
                replaced.append(name)
            else:
                walk(child, f"{name}.")

    walk(model, "")
    return replaced


def is_compiled(model: nn.Module) -> bool:
    """True for the module ``torch.compile(model)`` returns (an OptimizedModule)."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The eager module inside ``torch.compile(model)`` (names as the user knows them); else ``model``.

    Wrapping the inner module's blocks changes what the compiled module runs too: the compiled
    module calls the same submodules, and dynamo's guards recompile when a block's forward changes.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model
