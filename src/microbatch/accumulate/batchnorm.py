"""BatchNorm under gradient accumulation.

BatchNorm normalises each micro-batch with its own statistics, so accumulated gradients differ
from the full batch's (nothing but a larger micro-batch or another norm fixes that), and its
running statistics receive N updates per optimizer step instead of one. With momentum m, one
update decays the old running statistic by (1 - m); N updates with momentum m' decay it by
(1 - m')^N. Choosing m' = 1 - (1 - m)^(1/N) makes the decay per window exactly (1 - m).
"""

from __future__ import annotations

import logging
from typing import cast

from torch import nn

from ..errors import ConfigError
from ..trees.modules import modules_of_type, replace_modules
from .norm_subclasses import GroupNormThen, check_reproducible, is_plain_batchnorm

logger = logging.getLogger(__name__)

_BatchNorm = nn.modules.batchnorm._BatchNorm
_BATCHNORM = (_BatchNorm, nn.SyncBatchNorm)


def batchnorm_layers(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """(name, layer) of every BatchNorm layer in the model."""
    return [(name, cast(_BatchNorm, m)) for name, m in modules_of_type(model, _BATCHNORM)]


def corrected_momentum(momentum: float, steps: int) -> float:
    """Per-micro-batch momentum: ``steps`` updates decay old statistics as one update with ``momentum``."""
    if not 0.0 <= momentum <= 1.0:
        raise ConfigError(f"momentum must be in [0, 1], got {momentum}")
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    return 1.0 - float((1.0 - momentum) ** (1.0 / steps))


def convert_batchnorm_to_groupnorm(model: nn.Module, *, max_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm2d/1d/3d by a GroupNorm (in place), returning the model.

    GroupNorm normalises each sample on its own, so accumulated gradients equal the full batch's.
    The number of groups is the largest divisor of the channel count that is <= ``max_groups``;
    affine weights are carried over. A BatchNorm subclass that applies its own submodules after
    normalising (timm's ``BatchNormAct2d``: drop, then act) becomes a GroupNorm followed by those
    submodules (``GroupNormThen``); a subclass whose forward does anything else is refused with a
    ConfigError before any module is replaced (norm_subclasses.py).
    """
    if max_groups < 1:
        raise ConfigError(f"max_groups must be >= 1, got {max_groups}")
    for name, module in batchnorm_layers(model):
        if not is_plain_batchnorm(module):
            check_reproducible(name, module)

    def to_groupnorm(module: nn.Module) -> nn.Module:
        batchnorm = cast(_BatchNorm, module)  # selected by _BATCHNORM
        channels = batchnorm.num_features
        groups = max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)
        if is_plain_batchnorm(batchnorm):
            norm = nn.GroupNorm(groups, channels, eps=batchnorm.eps, affine=batchnorm.affine)
        else:
            norm = GroupNormThen(
                groups, channels, eps=batchnorm.eps, affine=batchnorm.affine, after=batchnorm
            )
        if batchnorm.affine:  # the GroupNorm's parameters where and as the BatchNorm's were
            norm.to(device=batchnorm.weight.device, dtype=batchnorm.weight.dtype)
            norm.weight.data.copy_(batchnorm.weight.data)
            norm.bias.data.copy_(batchnorm.bias.data)
        return norm.train(batchnorm.training)

    replace_modules(model, lambda module: isinstance(module, _BATCHNORM), to_groupnorm)
    return model


class BatchNormWindows:
    """The Accumulator's BatchNorm handling: one warning, and momentum corrected per window.

    ``set_momentum`` runs at construction and after every step() (for the next window), so a loop
    that calls backward()/step() by hand gets it as iterate() does; a window ended early with
    step(partial=True) decays by its planned count, not its actual one.
    """

    def __init__(self, model: nn.Module, correct_momentum: bool) -> None:
        self.layers = batchnorm_layers(model)
        self.momentum = {name: layer.momentum for name, layer in self.layers}
        self.warned = False
        self.corrects = correct_momentum and bool(self.layers)  # set_momentum has work to do

    def prepare(self, steps: int) -> None:
        """Before an iterate() window of ``steps`` planned micro-batches: warn once, set momentum."""
        if not self.layers:
            return
        training = [name for name, layer in self.layers if layer.training]
        if steps > 1 and training and not self.warned:
            self.warned = True
            logger.warning(
                "%d BatchNorm layer(s) (%s) train with %d micro-batches per step: each micro-batch is "
                "normalised with its own statistics, so gradients differ from the full batch's. Use "
                "larger micro-batches, convert with microbatch.convert_batchnorm_to_groupnorm(model), "
                "or freeze them (eval mode); correct_batchnorm_momentum=True makes the running "
                "statistics decay once per window.",
                len(training),
                ", ".join(training[:3]) + ("..." if len(training) > 3 else ""),
                steps,
            )
        self.set_momentum(steps)

    def set_momentum(self, steps: int) -> None:
        """correct_batchnorm_momentum: set the momentum for a window of ``steps`` planned micro-batches."""
        if not self.corrects:
            return
        for name, layer in self.layers:
            momentum = self.momentum[name]
            if momentum is not None:
                layer.momentum = corrected_momentum(momentum, steps)
