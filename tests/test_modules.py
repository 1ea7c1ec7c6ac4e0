"""The module-tree walker (microbatch.trees.modules) that checkpointing, batchnorm and verify share."""

from __future__ import annotations

import torch
from torch import nn

from microbatch.accumulate.batchnorm import batchnorm_layers, convert_batchnorm_to_groupnorm
from microbatch.trees.modules import ancestors, is_inside, modules_of_type, replace_modules


def _nested() -> nn.Module:
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4)))
    return nn.Sequential(inner, nn.BatchNorm2d(4), nn.Dropout(0.1))


def test_modules_of_type_lists_every_match_in_model_order() -> None:
    model = _nested()
    names = [name for name, _ in modules_of_type(model, nn.BatchNorm2d)]
    assert names == ["0.1", "0.2.0", "1"]
    assert modules_of_type(model, nn.Sequential)[0] == ("", model)  # the model itself counts
    assert [name for name, _ in modules_of_type(model, (nn.Conv2d, nn.Dropout))] == ["0.0", "2"]


def test_names_inside_and_around() -> None:
    assert ancestors("a.b.c") == ["", "a", "a.b"]
    assert ancestors("") == []
    assert is_inside("a.b", "a") and is_inside("a", "")
    assert not is_inside("a", "a") and not is_inside("ab.c", "a") and not is_inside("a", "a.b")


def test_replace_modules_replaces_without_descending_into_replacements() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Sequential(nn.ReLU()), nn.ReLU())
    seen: list[nn.Module] = []

    def select(module: nn.Module) -> bool:
        seen.append(module)
        return isinstance(module, nn.Sequential) and isinstance(module[-1], nn.ReLU) and len(module) == 1

    replaced = replace_modules(model, select, lambda module: nn.Identity())
    assert replaced == ["1"]
    assert isinstance(model[1], nn.Identity) and isinstance(model[0][1], nn.ReLU)
    assert all(not isinstance(module, nn.Identity) for module in seen)  # replacements are not walked


def test_groupnorm_conversion_through_the_walker_reaches_nested_layers() -> None:
    torch.manual_seed(0)
    model = _nested()
    before = [(name, layer.num_features) for name, layer in batchnorm_layers(model)]
    convert_batchnorm_to_groupnorm(model, max_groups=3)
    assert batchnorm_layers(model) == []
    groupnorms = modules_of_type(model, nn.GroupNorm)
    assert [(name, norm.num_channels) for name, norm in groupnorms] == before
    assert all(norm.num_groups == 2 for _, norm in groupnorms)  # largest divisor of 4 that is <= 3
