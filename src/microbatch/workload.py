"""What the planner, verify and the command line need from a user's code: a Workload.

A Workload bundles a model, a way to make a batch of any size, and a loss that says how many
items (samples, tokens) it averages over. The command line loads one by a built-in name or from
``package.module:function`` (a function that takes no arguments and returns a Workload).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import WorkloadError
from .memory.optimizer_state import fresh_optimizer_like

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, int | float | torch.Tensor]"]
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class Workload:
    """A model with its data and loss.

    model: the module to train.
    make_batch: ``make_batch(b)`` returns a batch of ``b`` samples (tensor, or nested tuple/list/dict of
        tensors with the samples along dimension 0). Successive calls may return different data.
    loss: ``loss(model, batch) -> (loss, items)``: the loss averaged over ``items`` (samples, or tokens
        that are not padding), and that count. The full-batch loss is the item-weighted mean.
    optimizer: optional: an optimizer instance over the model's parameters, or a factory
        ``optimizer(model) -> torch.optim.Optimizer``; AdamW(lr=1e-3) when absent. The planner never
        steps an instance: it steps a fresh one of the same class and parameter-group hyperparameters.
    max_length: set when samples vary in length (at most ``max_length`` tokens) and ``make_batch(b)``
        pads b rows to ``max_length`` (the worst case): the planner then also reports a token budget,
        ``Plan.max_tokens``, for micro-batches split with ``split_by_tokens``
        (see planner/result/token_budget.py).
    pipeline_inputs, pipeline_loss: what ``plan(..., pipeline=S)`` and its trial on the ranks need to
        cut the model into stages: ``pipeline_inputs(batch) -> (inputs, labels)`` (the one tensor the
        first stage takes, the labels the last stage's loss takes) and
        ``pipeline_loss(output, labels) -> (loss, items)``, with ``loss(model, batch)`` equal to
        ``pipeline_loss(model(inputs), labels)``.
    """

    model: nn.Module
    make_batch: Callable[[int], Any]
    loss: LossFn
    optimizer: OptimizerFactory | torch.optim.Optimizer | None = None
    name: str = "workload"
    description: str = ""
    max_length: int | None = None
    pipeline_inputs: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None
    pipeline_loss: Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]] | None = None

    def make_optimizer(self) -> torch.optim.Optimizer:
        """A new optimizer for the model, with empty state (never the user's instance itself)."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            known = {id(p) for p in self.model.parameters()}
            held = [p for group in self.optimizer.param_groups for p in group["params"]]
            if not any(id(p) in known for p in held):
                raise WorkloadError(
                    f"Workload(optimizer=...) of workload {self.name!r} is a {type(self.optimizer).__name__} "
                    "over none of the model's parameters; build it from model.parameters(), or pass a "
                    "factory: optimizer=lambda model: torch.optim.AdamW(model.parameters())"
                )
            return fresh_optimizer_like(self.optimizer)
        if self.optimizer is not None:
            if not callable(self.optimizer):
                raise WorkloadError(
                    f"Workload(optimizer=...) of workload {self.name!r} must be a torch.optim.Optimizer or a "
                    f"function model -> Optimizer, got {type(self.optimizer).__name__}"
                )
            optimizer = self.optimizer(self.model)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise WorkloadError(
                    f"Workload(optimizer=...) of workload {self.name!r} returned {type(optimizer).__name__}, "
                    "not a torch.optim.Optimizer"
                )
            return optimizer
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    @property
    def device(self) -> torch.device:
        for parameter in self.model.parameters():
            return parameter.device
        return torch.device("cpu")


def seed_linear() -> Workload:
    """The seed documents' example: nn.Linear(16, 1), mean squared error, 32 samples.

    The model and the 32 samples are drawn exactly as the seed code draws them (torch.manual_seed(0),
    then the layer, then x and y), inside fork_rng so the caller's random state is left alone.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(16, 1)
        inputs, targets = torch.randn(32, 16), torch.randn(32, 1)
    generator = torch.Generator().manual_seed(1)

    def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The seed example's 32 samples first; larger batches are drawn afresh.
        if batch_size <= inputs.shape[0]:
            return inputs[:batch_size], targets[:batch_size]
        return torch.randn(batch_size, 16, generator=generator), torch.randn(
            batch_size, 1, generator=generator
        )

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        return nn.functional.mse_loss(model(x), y), int(x.shape[0])

    return Workload(
        model=model,
        make_batch=make_batch,
        loss=loss,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        name="seed-linear",
        description="nn.Linear(16, 1), MSE, 32 samples: the seed documents' example",
    )


# name -> "module:function" (relative to the microbatch package) and a one-line description.
BUILTIN_WORKLOADS: dict[str, tuple[str, str]] = {
    "seed-linear": (
        "microbatch.workload:seed_linear",
        "nn.Linear(16, 1), MSE, 32 samples (the seed example)",
    ),
    "lm-varlen": (
        "microbatch.models.workloads:lm_varlen",
        "small causal language model on variable-length padded sequences (token-mean loss)",
    ),
    "cnn-bn": ("microbatch.models.workloads:cnn_bn", "small CNN with BatchNorm on generated images"),
    # The GPT sizes `microbatch train --model` takes (models.gpt.GPT_SIZES; a test keeps them equal).
    **{
        size: (
            f"microbatch.models.workloads:{size.replace('-', '_')}",
            f"built-in byte-level GPT ({size}) on the stdlib corpus",
        )
        for size in ("gpt-nano", "gpt-mini", "gpt-12l", "gpt-small", "gpt-medium")
    },
}


def _import_module(module_name: str, spec: str) -> Any:
    """``module_name`` imported; when it is not on sys.path but in the current directory, from there.

    ``python -m microbatch`` puts the current directory on sys.path and the ``microbatch`` script does
    not, so ``microbatch verify mymod:mlp`` beside mymod.py would fail where python -m works: the
    current directory is searched as python -m searches it, and a log line says so.
    """
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        top = module_name.split(".")[0]
        here = os.getcwd()
        beside = os.path.isfile(os.path.join(here, f"{top}.py")) or os.path.isdir(os.path.join(here, top))
        if error.name != top or not beside or here in sys.path:
            hint = (
                f"; neither sys.path nor the current directory {here} holds {top}.py or a package {top}/"
                if error.name == top
                else ""
            )
            raise WorkloadError(
                f"cannot import module {module_name!r} for workload {spec!r}: {error}{hint}"
            ) from error
        logger.info(
            "workload %s: importing %s from the current directory %s (as python -m does)", spec, top, here
        )
        sys.path.insert(0, here)
        return importlib.import_module(module_name)
    except ImportError as error:
        raise WorkloadError(f"cannot import module {module_name!r} for workload {spec!r}: {error}") from error


def _call_factory(target: str, spec: str) -> Workload:
    module_name, _, function_name = target.partition(":")
    if not module_name or not function_name:
        raise WorkloadError(f"workload {spec!r} must look like 'package.module:function'")
    module = _import_module(module_name, spec)
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise WorkloadError(f"module {module_name!r} has no function {function_name!r} (workload {spec!r})")
    try:
        inspect.signature(factory).bind()
    except TypeError as error:  # a factory that needs arguments: the user's to fix, not a bug
        raise WorkloadError(
            f"{spec!r}: {function_name}() is called with no arguments, but it needs some ({error}); "
            "give its parameters defaults, or point to a function that takes none"
        ) from error
    except ValueError:  # no signature to read (a builtin): call it and see
        pass
    workload = factory()
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"{spec!r} returned {type(workload).__name__}, not a microbatch.Workload; "
            "return Workload(model=..., make_batch=..., loss=...)"
        )
    return workload


def unknown_model_message(spec: str, *, more: dict[str, list[str]] | None = None) -> str:
    """'unknown model X. Did you mean Y? ...' listing every form a model name can take.

    ``more``: other named lists the caller accepts (the command line adds the embedded
    architectures, which live in a higher layer); every name is offered for "did you mean".
    """
    lists = {"built-in workloads": list(BUILTIN_WORKLOADS), **(more or {})}
    names = [name for values in lists.values() for name in values]
    close = difflib.get_close_matches(spec, names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    forms = "; ".join(f"{what}: {', '.join(values)}" for what, values in lists.items())
    return (
        f"unknown model {spec!r}.{hint} Give one of the {forms}; or a path to a Hugging Face config.json; "
        "or 'package.module:function' returning a microbatch.Workload (searched on sys.path and in the "
        "current directory)"
    )


def load_workload(spec: str) -> Workload:
    """A Workload from a built-in name (see BUILTIN_WORKLOADS) or 'package.module:function'."""
    if spec in BUILTIN_WORKLOADS:
        return _call_factory(BUILTIN_WORKLOADS[spec][0], spec)
    if ":" in spec:
        return _call_factory(spec, spec)
    raise WorkloadError(unknown_model_message(spec))
