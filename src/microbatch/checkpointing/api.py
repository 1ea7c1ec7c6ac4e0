"""Activation checkpointing that is safe by default.

``checkpoint(model, blocks=..., policy=...)`` wraps the forward of each chosen block in torch's
non-reentrant checkpoint (RNG state preserved, so dropout masks are identical on recompute) and
returns a handle whose ``remove()`` puts the original forwards back.

Memory per checkpointed block, for a block whose forward saves activations A (bytes) and whose
boundary input is X:

    policy="full"       keeps X; recomputes the forward in backward (A again, transiently)
    policy="selective"  keeps X and the outputs of matmul-like ops; recomputes the cheap ops only
    policy="selective-half"  keeps X, attention outputs and every second projection (torchtitan's
                        op-level policy, selective.py); recomputes the rest, half the projections
    policy="offload"    keeps X in host memory (pinned on CUDA); recomputes like "full"

torch stops a recompute once every saved tensor is back (early stop), so the recompute of a block
ending in, say, a projection feeding a residual add skips that projection: full checkpointing adds
at most one forward of each block, exactly one when the block's last op saves its output.

Safety beyond torch.utils.checkpoint:

- BatchNorm: the recompute would update running statistics a second time (pytorch #96136).
  The recompute writes into scratch copies instead, so running statistics and
  ``num_batches_tracked`` are updated exactly once per training forward.
- Caches: a recompute would write a KV cache twice. A checkpointed block called with
  ``use_cache=True`` or a past-key-values argument runs with the cache off (said once, at INFO).
  Calls under ``torch.no_grad()`` (evaluation, generation) are not checkpointed and pass untouched.
- Each block is checkpointed at most once; nesting is an error, not a silent double recompute.
- torch.compile: a block that dynamo traces runs a compile-safe form of its policy (compiled.py);
  a compiled model may be passed in (its blocks are named as in the eager model).

Here: choosing the blocks (``find_blocks``; "auto" in auto_blocks.py), wrapping them and undoing it
(``checkpoint``, ``CheckpointHandle``). Running a checkpointed block and its guards: recompute.py;
the selective policy: selective.py; offloading: offload.py; compiled code: compiled.py.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..trees.modules import ancestors, is_compiled, modules_of_type, unwrap_compiled
from . import compiled
from .auto_blocks import auto_blocks, describe_blocks
from .recompute import NORMS_WITH_RUNNING_STATS, RunningStatsGuard, cache_disabler, run_checkpointed
from .selective import HALF, SelectivePlan

logger = logging.getLogger(__name__)

__all__ = ["POLICIES", "CheckpointHandle", "checkpoint", "find_blocks"]

POLICIES = ("full", "selective", HALF, "offload")
BlockSpec = str | Sequence[str] | Callable[[str, nn.Module], bool]

# Set on a wrapped module's __dict__; its value is the policy. Used to detect nesting.
_MARKER = "_microbatch_checkpoint_policy"


# --------------------------------------------------------------------------------------------------
# Finding blocks


def _check_not_nested(names: Sequence[str]) -> None:
    chosen = set(names)
    for name in names:
        for ancestor in ancestors(name):
            if ancestor in chosen:
                raise CheckpointError(
                    f"blocks: {name!r} lies inside {ancestor!r}; a module can be checkpointed once. "
                    f"Choose either {ancestor!r} or the modules inside it"
                )


def find_blocks(model: nn.Module, blocks: BlockSpec = "auto") -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``blocks`` selects, in model order.

    ``blocks`` is "auto" (every repeated unit, across stages and shapes: see auto_blocks.py), a list
    of module names (as in ``model.named_modules()``), or a predicate ``(name, module) -> bool``
    applied to every submodule. The blocks may not nest.
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise CheckpointError(
                f"blocks={blocks!r}: pass 'auto', a list of module names such as [{blocks!r}], "
                "or a predicate (name, module) -> bool"
            )
        return auto_blocks(model)
    modules = dict(model.named_modules())
    if callable(blocks):
        predicate = blocks
        found = [(name, module) for name, module in modules.items() if name and predicate(name, module)]
        if not found:
            raise CheckpointError(
                f"blocks: the predicate selected no submodule of {type(model).__name__}; "
                "it is called as predicate(name, module) for every entry of model.named_modules()"
            )
    elif isinstance(blocks, Sequence):
        names = list(blocks)
        if not names:
            raise CheckpointError("blocks=[]: name at least one module, or pass blocks='auto'")
        for name in names:
            if not isinstance(name, str) or name not in modules or not name:
                close = difflib.get_close_matches(str(name), [n for n in modules if n], n=5, cutoff=0.5)
                hint = f"close matches: {', '.join(close)}" if close else "see model.named_modules()"
                raise CheckpointError(
                    f"blocks: {type(model).__name__} has no submodule named {name!r}; {hint}"
                )
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise CheckpointError(f"blocks: {', '.join(map(repr, duplicates))} named more than once")
        order = {name: index for index, name in enumerate(modules)}
        found = sorted(((name, modules[name]) for name in names), key=lambda item: order[item[0]])
    else:
        raise CheckpointError(
            f"blocks must be 'auto', a list of module names or a predicate, got {type(blocks).__name__}"
        )
    _check_not_nested([name for name, _ in found])
    return found


# --------------------------------------------------------------------------------------------------
# Offload


def _offload_saved_inputs(*, copy_host_tensors: bool = False) -> torch.autograd.graph.saved_tensors_hooks:
    """Keep the tensors saved under this context in host memory until backward needs them.

    Around a checkpoint call the only tensors saved here are the block's inputs (the checkpoint's
    own hooks take over inside the block). The copies run on a side stream, and backward prefetches
    the next block's input (microbatch.checkpointing.offload). Host tensors stay as they are unless
    ``copy_host_tensors`` (tests use it to exercise the round trip on CPU).
    """
    from .offload import saved_on_host

    return saved_on_host(copy_host_tensors=copy_host_tensors)


# --------------------------------------------------------------------------------------------------
# Wrapping


class CheckpointHandle:
    """The checkpointed blocks of one ``checkpoint()`` call; ``remove()`` restores the originals."""

    def __init__(self, model: nn.Module, policies: dict[str, str]) -> None:
        self.blocks: list[str] = list(policies)
        self.policies: dict[str, str] = dict(policies)
        self._model_name = type(model).__name__
        # module -> (had its own instance attribute "forward", that attribute)
        self._originals: list[tuple[nn.Module, bool, Any]] = []
        self._cache_notice_given = False
        self.removed = False
        # True once dynamo traced a block: the blocks then run in compiled.COMPILED_FORMS
        self.compiled_calls = False

    def remove(self) -> None:
        """Restore every wrapped block's original forward exactly; a second call does nothing."""
        for module, had_instance_forward, original in reversed(self._originals):
            if had_instance_forward:
                module.__dict__["forward"] = original
            else:
                module.__dict__.pop("forward", None)
            module.__dict__.pop(_MARKER, None)
        self._originals.clear()
        self.removed = True

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        shown = ", ".join(f"{name}={policy}" for name, policy in self.policies.items())
        return f"CheckpointHandle({self._model_name}, {state}: {shown})"

    def _notice_cache_off(self, name: str) -> None:
        if not self._cache_notice_given and not compiled.is_compiling():  # a log call breaks a graph
            self._cache_notice_given = True
            logger.info(
                "checkpointed block %r was called with a cache during training; the cache is turned "
                "off for checkpointed calls so recomputation cannot write it twice",
                name,
            )

    def _wrap(self, name: str, module: nn.Module, policy: str) -> None:
        had_instance_forward = "forward" in module.__dict__
        self._originals.append((module, had_instance_forward, module.__dict__.get("forward")))
        module.__dict__["forward"] = CheckpointedForward(self, name, module, policy, module.forward)
        module.__dict__[_MARKER] = policy


class CheckpointedForward:
    """The forward a checkpointed block runs: its original forward, through its policy.

    An object rather than a closure so that ``copy.deepcopy`` of the model (an EMA copy, a trial
    copy) gives the copy a forward of its own: a closure would be copied as itself and keep calling
    the original block, so the copy's outputs came from the original's weights and its gradients
    landed there. ``__deepcopy__`` rebinds the original forward to the copied block and makes fresh
    guards for the copy's norms; the copy stays checkpointed, and the handle's ``remove()`` restores
    the original model only.
    """

    def __init__(
        self,
        handle: CheckpointHandle,
        name: str,
        module: nn.Module,
        policy: str,
        original: Callable[..., Any],
    ) -> None:
        self.handle, self.name, self.module = handle, name, module
        self.policy, self.original = policy, original
        # made on the first call: during a deepcopy the copied block is not whole yet
        self._guard: RunningStatsGuard | None = None
        self._guard_made = False
        self.plan = SelectivePlan(half=policy == HALF) if policy in ("selective", HALF) else None
        self.cache_off = cache_disabler(original, lambda: handle._notice_cache_off(name))
        functools.update_wrapper(self, original)  # signature and name of the block's own forward

    def guard(self) -> RunningStatsGuard | None:
        """Scratch running statistics for the block's norms (None without any)."""
        if not self._guard_made:
            norms = [norm for _, norm in modules_of_type(self.module, NORMS_WITH_RUNNING_STATS)]
            self._guard = RunningStatsGuard(norms) if norms else None
            self._guard_made = True
        return self._guard

    def _saving(self) -> Any:
        # looked up per call (tests replace _offload_saved_inputs to force host copies on CPU)
        return _offload_saved_inputs() if self.policy == "offload" else contextlib.nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        args, kwargs = self.cache_off(args, kwargs)
        if compiled.is_compiling():  # traced by dynamo: no Python runs in the compiled backward
            self.handle.compiled_calls = True
            return compiled.run_compiled(self.original, self.policy, args, kwargs)
        return run_checkpointed(
            self.original, self._saving, self.guard(), self.plan, args, kwargs, block=self.name
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointedForward:
        # memo maps the block being copied to its copy, so both deepcopies below land on the copy
        module = copy.deepcopy(self.module, memo)
        original = copy.deepcopy(self.original, memo)  # a bound method is rebound to the copy
        return CheckpointedForward(self.handle, self.name, module, self.policy, original)


def _resolve_policies(model: nn.Module, blocks: BlockSpec, policy: str | Mapping[str, str]) -> dict[str, str]:
    options = ", ".join(map(repr, POLICIES))
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ConfigError(f"policy={policy!r} is not a checkpoint policy; choose one of {options}")
        return {name: policy for name, _ in find_blocks(model, blocks)}
    if not isinstance(policy, Mapping):
        raise ConfigError(
            f"policy must be one of {options} or a dict of block name -> policy, got {type(policy).__name__}"
        )
    for name, value in policy.items():
        if value not in (*POLICIES, "none"):
            raise ConfigError(
                f"policy[{name!r}]={value!r} is not a checkpoint policy; choose one of {options} or 'none'"
            )
    if not (isinstance(blocks, str) and blocks == "auto") and (
        isinstance(blocks, str) or callable(blocks) or set(blocks) != set(policy)
    ):
        raise ConfigError(
            "with a policy dict the blocks are its keys; leave blocks='auto' (unused) or pass the same names"
        )
    found = find_blocks(model, list(policy))
    return {name: policy[name] for name, _ in found if policy[name] != "none"}


def _check_not_checkpointed(modules: Mapping[str, nn.Module], name: str) -> None:
    """Neither block ``name``, nor a module around it, nor one inside it is checkpointed already."""
    for other_name in ancestors(name):
        if _MARKER in modules[other_name].__dict__:
            where = f"{other_name!r}" if other_name else "the model itself"
            raise CheckpointError(
                f"blocks: {name!r} lies inside {where}, which is already checkpointed; "
                "remove() the earlier handle first"
            )
    for inner_name, inner in modules[name].named_modules():
        if _MARKER in inner.__dict__:
            full_name = f"{name}.{inner_name}" if inner_name else name
            raise CheckpointError(
                f"blocks: {full_name!r} is already checkpointed; a module can be checkpointed once. "
                "remove() the earlier handle first"
            )


def _turn_off_hf_checkpointing(model: nn.Module) -> None:
    """transformers' own gradient checkpointing off: with ours on top, blocks would recompute twice."""
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (old names warn).
    # Asked of the instance, not its class: a peft model forwards both names to the model it wraps.
    new_names = hasattr(model, "is_activation_checkpointing")
    prefix = "activation" if new_names else "gradient"
    if getattr(model, f"is_{prefix}_checkpointing", False) is True:
        getattr(model, f"{prefix}_checkpointing_disable")()
        logger.warning(
            "%s had transformers' gradient checkpointing on; turned it off "
            "(model.%s_checkpointing_disable()) so that microbatch's checkpointing alone decides "
            "what is recomputed. handle.remove() does not turn it back on",
            type(model).__name__,
            prefix,
        )


def checkpoint(
    model: nn.Module,
    blocks: BlockSpec = "auto",
    policy: str | Mapping[str, str] = "full",
) -> CheckpointHandle:
    """Checkpoint ``model``'s blocks in place; returns a handle whose ``remove()`` undoes it.

    ``blocks``: "auto", a list of module names, or a predicate (see ``find_blocks``).
    ``policy``: "full", "selective", "selective-half" or "offload" for all blocks, or a dict of block
    name -> policy ("none" leaves a block alone), in which case the dict's keys are the blocks.

    Raises CheckpointError (unknown or nested blocks, nothing repeated for "auto", a block already
    checkpointed) or ConfigError (unknown policy); the model is untouched when it raises.
    """
    compiled_model = is_compiled(model)
    model = unwrap_compiled(model)  # names as in the eager model, not "_orig_mod."
    policies = _resolve_policies(model, blocks, policy)
    modules = dict(model.named_modules())
    for name in policies:
        _check_not_checkpointed(modules, name)
    _turn_off_hf_checkpointing(model)
    handle = CheckpointHandle(model, policies)
    if "offload" in policies.values() and not torch.cuda.is_available():
        logger.warning(
            "policy='offload' without CUDA changes nothing: the block inputs already live in host memory"
        )
    for name, block_policy in policies.items():
        handle._wrap(name, modules[name], block_policy)
    if compiled_model:
        logger.info("%s", compiled.compiled_notice(policies))
    if isinstance(blocks, str) and isinstance(policy, str):  # say what "auto" picked
        picked = describe_blocks([(name, modules[name]) for name in policies])
        logger.info("checkpoint: blocks='auto' picked %s, policy=%r", picked, policy)
    logger.debug("checkpointed %d blocks: %s", len(policies), handle.policies)
    return handle
