"""Activation checkpointing that is safe by default.

``checkpoint(model, blocks=..., policy=...)`` wraps the forward of each chosen block in torch's
non-reentrant checkpoint (RNG state preserved, so dropout masks are identical on recompute) and
returns a handle whose ``remove()`` puts the original forwards back.

Memory per checkpointed block, for a block whose forward saves activations A (bytes) and whose
boundary input is X:

    policy="full"       keeps X; recomputes the forward in backward (A again, transiently)
    policy="selective"  keeps X and the outputs of matmul-like ops; recomputes the cheap ops only
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
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

__all__ = ["POLICIES", "CheckpointHandle", "checkpoint", "find_blocks"]

POLICIES = ("full", "selective", "offload")
BlockSpec = str | Sequence[str] | Callable[[str, nn.Module], bool]

# Set on a wrapped module's __dict__; its value is the policy. Used to detect nesting.
_MARKER = "_microbatch_checkpoint_policy"
_NORM_WITH_RUNNING_STATS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
# Argument names through which a block receives a cache it would write into.
_CACHE_SWITCHES = ("use_cache",)
_CACHE_OBJECTS = (
    "past_key_values",
    "past_key_value",
    "layer_past",
    "kv_cache",
    "cache",
)  # "cache": transformers 5
# Matmul-like aten ops whose outputs the selective policy saves (everything else is recomputed).
# These are all the ops FlopCounterMode counts, so selective recomputation adds no FLOPs.
_MATMUL_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_MATMUL_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in _MATMUL_OP_NAMES if hasattr(torch.ops.aten, name)
)


# --------------------------------------------------------------------------------------------------
# Finding blocks


def _signature(module: nn.Module) -> tuple[Any, ...]:
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Largest run of consecutive same-class, same-shape children of any ModuleList / Sequential.

    Ties go to the run with more parameters, then to the one found first. Blocks without
    parameters (activations, dropout) are not candidates: checkpointing them saves nothing.
    """
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
    if not best:
        raise CheckpointError(
            f"blocks='auto' found no repeated blocks in {type(model).__name__}: no nn.ModuleList or "
            "nn.Sequential holds two or more consecutive modules of the same class and parameter shapes. "
            "Name the blocks instead, e.g. blocks=['encoder.0', 'encoder.1'] (see model.named_modules()), "
            "or pass a predicate such as blocks=lambda name, module: isinstance(module, MyBlock)"
        )
    return best


def _check_not_nested(names: Sequence[str]) -> None:
    chosen = set(names)
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            ancestor = ".".join(parts[:depth])
            if ancestor in chosen:
                raise CheckpointError(
                    f"blocks: {name!r} lies inside {ancestor!r}; a module can be checkpointed once. "
                    f"Choose either {ancestor!r} or the modules inside it"
                )


def find_blocks(model: nn.Module, blocks: BlockSpec = "auto") -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``blocks`` selects, in model order.

    ``blocks`` is "auto" (the largest run of repeated blocks in any ModuleList / Sequential, wherever
    it lives), a list of module names (as in ``model.named_modules()``), or a predicate
    ``(name, module) -> bool`` applied to every submodule. The blocks may not nest.
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise CheckpointError(
                f"blocks={blocks!r}: pass 'auto', a list of module names such as [{blocks!r}], "
                "or a predicate (name, module) -> bool"
            )
        return _auto_blocks(model)
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
# Policies


_OpKey = tuple[Any, int]  # (aten op, how many times the block ran it before) within one forward


class _OpsReached(TorchDispatchMode):
    """Records which ops a recompute reaches (torch stops it once every saved tensor is back)."""

    def __init__(self, reached: set[_OpKey]) -> None:
        super().__init__()
        self.reached = reached
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.reached.add((func, self.counts[func]))
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


class _SelectivePlan:
    """Which matmul-like outputs one block's selective checkpoint saves.

    Every matmul output is saved, except those a recompute never needed: with early stopping, the
    recompute ends at the block's last saved tensor, so a final matmul whose output nothing inside
    the block saves (a projection feeding a residual add) is never rerun, and caching its output
    would only cost memory. Each recompute teaches the plan which saved outputs it did not reach;
    a skipped op that a later recompute does reach is saved again. Correct either way: an op not
    saved is recomputed.
    """

    # Recording costs a Python dispatch per recomputed op; stop once the plan has held this long.
    STABLE_AFTER = 2

    def __init__(self) -> None:
        self.skip: frozenset[_OpKey] = frozenset()
        self.unchanged = 0  # recomputes in a row that left the plan as it was

    def contexts(self, saved: set[_OpKey], reached: set[_OpKey]) -> tuple[Any, Any]:
        counts: dict[Any, int] = defaultdict(int)
        skip = self.skip

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
            key = (op, counts[op])
            counts[op] += 1
            if getattr(op, "overloadpacket", None) in _MATMUL_OPS and key not in skip:
                saved.add(key)
                return torch_checkpoint.CheckpointPolicy.MUST_SAVE
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(policy)
        if self.unchanged >= self.STABLE_AFTER:
            return caching, cached

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with cached, _OpsReached(reached):  # the recorder sees each op before the cache answers it
                yield

        return caching, recompute()

    def learn(self, saved: set[_OpKey], reached: set[_OpKey]) -> None:
        if not reached:  # not recorded (plan stable), or a recompute that ran nothing
            return
        skip = frozenset((self.skip | saved) - reached)
        self.unchanged = self.unchanged + 1 if skip == self.skip else 0
        self.skip = skip


def _offload_saved_inputs(*, copy_host_tensors: bool = False) -> torch.autograd.graph.saved_tensors_hooks:
    """Keep the tensors saved under this context in host memory until backward needs them.

    Around a checkpoint call the only tensors saved here are the block's inputs (the checkpoint's
    own hooks take over inside the block). The copies run on a side stream, and backward prefetches
    the next block's input (microbatch.offload). Host tensors stay as they are unless
    ``copy_host_tensors`` (tests use it to exercise the round trip on CPU).
    """
    from .offload import saved_on_host

    return saved_on_host(copy_host_tensors=copy_host_tensors)


class _RunningStatsGuard:
    """Lets a recompute update scratch copies of the running statistics instead of the real ones.

    In training mode a BatchNorm's output uses the batch's own statistics, so the recompute's output
    does not depend on the running buffers; only their second in-place update must not land. The
    recompute runs inside torch's checkpoint (and selective-checkpoint dispatch modes), where extra
    tensor ops are not allowed, so the scratch buffers are made beforehand (``prepare``, outside the
    checkpoint) and the recompute only swaps module attributes. Cost: one copy of the norms' buffers.
    """

    def __init__(self, norms: Sequence[nn.Module]) -> None:
        self.norms = list(norms)
        self.scratch: dict[tuple[int, str], torch.Tensor] = {}

    def _updating(self) -> list[nn.Module]:
        return [m for m in self.norms if m.training and getattr(m, "track_running_stats", False)]

    def prepare(self) -> None:
        for module in self._updating():
            for name, buffer in module.named_buffers(recurse=False):
                key = (id(module), name)
                known = self.scratch.get(key)
                if known is None or (known.shape, known.dtype, known.device) != (
                    buffer.shape,
                    buffer.dtype,
                    buffer.device,
                ):
                    self.scratch[key] = buffer.detach().clone()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        originals: list[tuple[nn.Module, str, torch.Tensor]] = []
        try:
            for module in self._updating():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    scratch = self.scratch.get((id(module), name))
                    if scratch is not None:
                        originals.append((module, name, buffer))
                        setattr(module, name, scratch)
            yield
        finally:
            for module, name, buffer in originals:
                setattr(module, name, buffer)


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
        if not self._cache_notice_given:
            self._cache_notice_given = True
            logger.info(
                "checkpointed block %r was called with a cache during training; the cache is turned "
                "off for checkpointed calls so recomputation cannot write it twice",
                name,
            )

    def _wrap(self, name: str, module: nn.Module, policy: str) -> None:
        had_instance_forward = "forward" in module.__dict__
        original = module.forward
        norms = [m for m in module.modules() if isinstance(m, _NORM_WITH_RUNNING_STATS)]
        guard = _RunningStatsGuard(norms) if norms else None
        plan = _SelectivePlan() if policy == "selective" else None
        cache_off = _cache_disabler(original, lambda: self._notice_cache_off(name))

        @functools.wraps(original)
        def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            args, kwargs = cache_off(args, kwargs)
            return _run_checkpointed(original, policy, guard, plan, args, kwargs)

        self._originals.append((module, had_instance_forward, module.__dict__.get("forward")))
        module.__dict__["forward"] = checkpointed_forward
        module.__dict__[_MARKER] = policy


def _cache_disabler(
    forward: Callable[..., Any], notice: Callable[[], None]
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    """A function that turns the cache arguments of ``forward`` off: use_cache=False, caches None."""
    positions: dict[str, int] = {}
    with contextlib.suppress(TypeError, ValueError):
        for index, parameter in enumerate(inspect.signature(forward).parameters.values()):
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                positions[parameter.name] = index

    def is_on(value: Any) -> bool:  # identity tests: a cache may be a tensor, whose == is elementwise
        return value is not None and value is not False

    def disable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        changed = False
        new_args, new_kwargs = list(args), dict(kwargs)
        for name in (*_CACHE_SWITCHES, *_CACHE_OBJECTS):
            off = False if name in _CACHE_SWITCHES else None
            if name in new_kwargs:
                if is_on(new_kwargs[name]):
                    new_kwargs[name], changed = off, True
            elif positions.get(name, len(new_args)) < len(new_args) and is_on(new_args[positions[name]]):
                new_args[positions[name]], changed = off, True
        if not changed:
            return args, kwargs
        notice()
        return tuple(new_args), new_kwargs

    return disable


def _run_checkpointed(
    forward: Callable[..., Any],
    policy: str,
    guard: _RunningStatsGuard | None,
    plan: _SelectivePlan | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    # Keyword arguments travel positionally so that torch saves their tensors with the other
    # inputs (through the offload hooks, when offloading) and no name can clash with checkpoint's.
    num_args, keyword_names = len(args), list(kwargs)
    calls = 0

    def run(*inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        call_args, call_kwargs = inputs[:num_args], dict(zip(keyword_names, inputs[num_args:], strict=True))
        if calls == 1:
            return forward(*call_args, **call_kwargs)
        # a recompute, inside backward; it may end early by an exception (torch's early stop)
        try:
            with guard.swapped() if guard is not None else contextlib.nullcontext():
                return forward(*call_args, **call_kwargs)
        finally:
            if plan is not None:
                plan.learn(saved, reached)

    if guard is not None:
        guard.prepare()

    saved: set[_OpKey] = set()
    reached: set[_OpKey] = set()
    context_fn: Callable[[], tuple[Any, Any]] = torch_checkpoint.noop_context_fn
    if plan is not None:
        context_fn = functools.partial(plan.contexts, saved, reached)
    saving = _offload_saved_inputs() if policy == "offload" else contextlib.nullcontext()
    with saving:
        return torch_checkpoint.checkpoint(
            run,
            *args,
            *kwargs.values(),
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=context_fn,
        )


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


def checkpoint(
    model: nn.Module,
    blocks: BlockSpec = "auto",
    policy: str | Mapping[str, str] = "full",
) -> CheckpointHandle:
    """Checkpoint ``model``'s blocks in place; returns a handle whose ``remove()`` undoes it.

    ``blocks``: "auto", a list of module names, or a predicate (see ``find_blocks``).
    ``policy``: "full", "selective" or "offload" for all blocks, or a dict of block name -> policy
    ("none" leaves a block alone), in which case the dict's keys are the blocks.

    Raises CheckpointError (unknown or nested blocks, nothing repeated for "auto", a block already
    checkpointed) or ConfigError (unknown policy); the model is untouched when it raises.
    """
    policies = _resolve_policies(model, blocks, policy)
    modules = dict(model.named_modules())
    for name in policies:
        module = modules[name]
        parts = name.split(".")
        ancestors = [".".join(parts[:depth]) for depth in range(len(parts))]
        for other_name in ancestors:
            if _MARKER in modules[other_name].__dict__:
                where = f"{other_name!r}" if other_name else "the model itself"
                raise CheckpointError(
                    f"blocks: {name!r} lies inside {where}, which is already checkpointed; "
                    "remove() the earlier handle first"
                )
        for inner_name, inner in module.named_modules():
            if _MARKER in inner.__dict__:
                full_name = f"{name}.{inner_name}" if inner_name else name
                raise CheckpointError(
                    f"blocks: {full_name!r} is already checkpointed; a module can be checkpointed once. "
                    "remove() the earlier handle first"
                )
    handle = CheckpointHandle(model, policies)
    if "offload" in policies.values() and not torch.cuda.is_available():
        logger.warning(
            "policy='offload' without CUDA changes nothing: the block inputs already live in host memory"
        )
    for name, block_policy in policies.items():
        handle._wrap(name, modules[name], block_policy)
    logger.debug("checkpointed %d blocks: %s", len(policies), handle.policies)
    return handle
