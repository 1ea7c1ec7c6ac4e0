"""convert_batchnorm_to_groupnorm on BatchNorm subclasses that do more than normalise.

timm's BatchNormAct2d normalises, then applies its ``drop`` and ``act`` submodules; converting it to
a bare GroupNorm deleted the activations. Here a local replica of it (and of subclasses that cannot
be reproduced) against a hand-built reference: conv -> GroupNorm -> dropout -> SiLU, float64,
outputs and gradients rtol = atol = 1e-12 (the same ops in the same order; rounding noise only).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import microbatch as mb
from microbatch.accumulate.norm_subclasses import GroupNormThen
from microbatch.errors import ConfigError

TOL = {"rtol": 1e-12, "atol": 1e-12}


class BatchNormAct2d(nn.BatchNorm2d):
    """As timm's: BatchNorm2d's normalisation, then ``drop``, then ``act`` (in place)."""

    def __init__(self, channels: int, *, drop: float = 0.0) -> None:
        super().__init__(channels)
        self.drop = nn.Dropout(drop) if drop else nn.Identity()
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps
        )
        return self.act(self.drop(x))  # type: ignore[no-any-return]


class ActBeforeNorm(nn.BatchNorm2d):
    """Applies its activation before normalising: no GroupNorm followed by anything reproduces it."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.act(x))


class ScaledNorm(nn.BatchNorm2d):
    """No submodules, but a forward that rescales the normalised output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


class RenamedNorm(nn.BatchNorm2d):
    """A subclass that changes nothing but its name: a plain GroupNorm stands in for it."""


def cnn(norm: type[nn.Module], **options: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        norm(8, **options),
        nn.Conv2d(8, 8, 3, padding=1),
        norm(8, **options),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    ).double()


def reference_of(converted_from: nn.Sequential, drop: float) -> nn.Sequential:
    """The model the conversion should give, built by hand: GroupNorm, dropout, SiLU after each conv."""
    layers: list[nn.Module] = []
    for module in converted_from:
        if isinstance(module, nn.BatchNorm2d):
            norm = nn.GroupNorm(8, 8).double()
            norm.load_state_dict({"weight": module.weight.detach(), "bias": module.bias.detach()})
            layers += [norm, nn.Dropout(drop) if drop else nn.Identity(), nn.SiLU()]
        else:
            layers.append(copy.deepcopy(module))
    return nn.Sequential(*layers)


@pytest.mark.parametrize("drop", [0.0, 0.25])
def test_fused_activation_and_dropout_survive_the_conversion(drop: float) -> None:
    model = cnn(BatchNormAct2d, drop=drop)
    with torch.no_grad():  # affine weights other than the defaults, so that carrying them counts
        for module in model:
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    reference = reference_of(model, drop)
    mb.convert_batchnorm_to_groupnorm(model)

    norms = [module for module in model if isinstance(module, nn.GroupNorm)]
    assert [type(norm) for norm in norms] == [GroupNormThen, GroupNormThen]
    assert sum(isinstance(m, nn.SiLU) for m in model.modules()) == 2  # none deleted
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert norms[0].weight.dtype == torch.float64

    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    outputs, grads = [], []
    for net in (model, reference):
        inputs = x.clone().requires_grad_(True)
        torch.manual_seed(3)  # the same dropout mask on both sides
        out = net(inputs)
        out.square().sum().backward()
        outputs.append(out.detach())
        grads.append((inputs.grad, [p.grad for p in net.parameters()]))
    torch.testing.assert_close(outputs[0], outputs[1], **TOL)
    torch.testing.assert_close(grads[0][0], grads[1][0], **TOL)
    for got, want in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_converted_subclass_keeps_names_and_the_accumulated_gradient_is_the_full_batch() -> None:
    model = mb.convert_batchnorm_to_groupnorm(cnn(BatchNormAct2d))
    assert {"1.weight", "1.bias", "3.weight", "3.bias"} <= set(model.state_dict())
    assert isinstance(model[1].act, nn.SiLU) and model[1].act.inplace
    x, y = torch.randn(8, 3, 5, 5, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    F.mse_loss(model(x), y, reduction="sum").backward()
    full = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    for rows in (slice(0, 3), slice(3, 8)):  # per-sample norms: micro-batches sum to the full batch
        F.mse_loss(model(x[rows]), y[rows], reduction="sum").backward()
    for got, want in zip((p.grad for p in model.parameters()), full, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_a_subclass_that_only_renames_becomes_a_groupnorm_of_nothing_more() -> None:
    model = mb.convert_batchnorm_to_groupnorm(cnn(RenamedNorm))
    assert isinstance(model[1], nn.GroupNorm) and list(model[1].children()) == []


@pytest.mark.parametrize("norm", [ActBeforeNorm, ScaledNorm], ids=lambda n: n.__name__)
def test_a_subclass_whose_forward_cannot_be_reproduced_is_refused_untouched(norm: type[nn.Module]) -> None:
    model = nn.Sequential(nn.BatchNorm2d(8), nn.Conv2d(8, 8, 1), norm(8)).double()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=rf"'2' is a {norm.__name__}, a BatchNorm subclass"):
        mb.convert_batchnorm_to_groupnorm(model)
    assert type(model[0]) is nn.BatchNorm2d and type(model[2]) is norm  # nothing replaced
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # the probe ran on copies
