"""BatchNorm subclasses under convert_batchnorm_to_groupnorm: keep what they do besides normalising.

Libraries fuse more into a BatchNorm subclass: timm's ``BatchNormAct2d`` normalises, then applies
its ``drop`` and ``act`` submodules. A plain GroupNorm in its place would silently delete them. A
subclass is converted to ``GroupNormThen``: the GroupNorm followed by the subclass's own submodules,
under their names, in the order they were registered. That is faithful only when the subclass's
forward is "normalise as BatchNorm does, then apply the submodules in registration order"; a probe
checks exactly that on a small random input (both sides in training mode under the same RNG seed,
so a dropout inside is compared too) and refuses any subclass whose forward does something else.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["GroupNormThen", "check_reproducible", "is_plain_batchnorm"]

_BatchNorm = nn.modules.batchnorm._BatchNorm
_PLAIN = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
)
# Input shapes tried, (batch, channels, *spatial): the first one the subclass accepts is probed.
_PROBE_SPATIAL = ((3, 3), (4,), (2, 2, 2), ())


class GroupNormThen(nn.GroupNorm):
    """A GroupNorm followed by the submodules of the BatchNorm subclass it replaced (same names)."""

    def __init__(self, groups: int, channels: int, *, eps: float, affine: bool, after: nn.Module) -> None:
        super().__init__(groups, channels, eps=eps, affine=affine)
        self.replaced = type(after).__name__
        for name, child in after.named_children():
            self.add_module(name, child)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        for child in self.children():
            x = child(x)
        return x

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, replaces {self.replaced}"


def is_plain_batchnorm(module: nn.Module) -> bool:
    """One of torch's own BatchNorm classes, whose forward is exactly BatchNorm's."""
    return type(module) in _PLAIN


def _normalise_then_children(module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    x = _BatchNorm.forward(module, x)
    for child in module.children():
        x = child(x)
    return x


def _probe_input(module: _BatchNorm) -> torch.Tensor | None:
    """A small random input the subclass's forward accepts, or None when it accepts none."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    floats = [t for t in tensors if t.is_floating_point()]  # not num_batches_tracked, an integer
    dtype = floats[0].dtype if floats else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    for spatial in _PROBE_SPATIAL:
        x = torch.randn(4, module.num_features, *spatial, dtype=dtype, device=device)
        try:
            with torch.no_grad():
                copy.deepcopy(module).train()(x.clone())
        except Exception:  # the subclass rejects this shape: try the next
            continue
        return x
    return None


def check_reproducible(name: str, module: nn.Module) -> None:
    """Raise ConfigError unless ``module``'s forward is BatchNorm's followed by its submodules in
    registration order (what GroupNormThen reproduces with a GroupNorm instead)."""
    batchnorm = cast(_BatchNorm, module)
    kind = type(module).__name__
    x = _probe_input(batchnorm)
    matches = False
    if x is not None:
        with torch.no_grad(), torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            torch.manual_seed(0)
            own = copy.deepcopy(batchnorm).train()(x.clone())
            torch.manual_seed(0)
            reproduced = _normalise_then_children(copy.deepcopy(batchnorm).train(), x.clone())
        matches = isinstance(own, torch.Tensor) and own.shape == reproduced.shape
        matches = matches and torch.allclose(own, reproduced, rtol=1e-5, atol=1e-6)
    if not matches:
        children = ", ".join(child for child, _ in module.named_children()) or "no submodules"
        raise ConfigError(
            f"convert_batchnorm_to_groupnorm: {name!r} is a {kind}, a BatchNorm subclass whose forward "
            f"is not BatchNorm followed by its submodules in order ({children}), so a GroupNorm cannot "
            "stand in for it faithfully. Replace it yourself (microbatch.trees.modules.replace_modules), "
            "or keep BatchNorm and use larger micro-batches; the model is unchanged"
        )
