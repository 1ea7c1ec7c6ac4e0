"""The selective checkpoint policies: save the outputs of matmul-like ops, recompute the cheap ops.

Every op that FlopCounterMode counts is in MATMUL_OPS, so a selective recompute adds no FLOPs; it
reruns only elementwise ops, norms and the like. compiled.py uses the same op list in its
compile-safe form of the policy.

"selective-half" is torchtitan's op-level selective policy as torchtitan runs it: it saves every
second projection (PROJECTION_OPS: the 1st, 3rd, 5th ... mm or addmm of the block's forward) and
every other matmul-like output (attention kernels, bmm, convolutions), and recomputes the rest. It
learns no skip set (a last projection the recompute never reruns is saved, as torchtitan saves it),
so a plan made with it holds what torchtitan's runs hold. In a Llama layer the projections run as
q, k, v, o, gate, up, down: it keeps q, v, gate and down besides the attention output and the
block's input, per token (3 d + d_kv + d_ff) x itemsize + the input's d x itemsize, where
"selective" keeps (3 d + 2 d_kv + 2 d_ff) x itemsize + the input (down skipped: never rerun), and it
reruns k, o and up (three of the seven matmuls). llama-3.1-8b (d 4096, d_kv 1024, d_ff 14336, bf16)
at 2 x 8192 tokens: 994 MiB per layer against 1,474 MiB (tests/test_selective_half.py).

In-place ops: a saved output that a later op of the block writes into (conv -> ReLU(inplace=True),
``out += residual``) no longer holds the value the recompute needs, and torch refuses it in backward
("Tensor cached during selective activation checkpoint has been mutated"). The forward watches every
op that writes into a tensor (its schema marks the argument as written) and compares the written
storage with the saved outputs' storages. A forward that wrote into a saved output recomputes
without the cache (as policy="full" would: correct, more FLOPs), and from the next forward on that
output's producer is recomputed instead of saved.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HALF", "MATMUL_OPS", "PROJECTION_OPS", "OpKey", "SelectivePlan", "every_second_projection"]

HALF = "selective-half"  # the policy name: every second projection saved

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
MATMUL_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in _MATMUL_OP_NAMES if hasattr(torch.ops.aten, name)
)
# The projections (nn.Linear runs as mm, or addmm with a bias) that "selective-half" alternates.
PROJECTION_OPS = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm})


def every_second_projection() -> Any:
    """A counter for one forward of one block: called with each op, True for the projections that
    "selective-half" recomputes (the 2nd, 4th, ... mm or addmm of that forward)."""
    projections = 0

    def recomputed(op: Any) -> bool:
        nonlocal projections
        if getattr(op, "overloadpacket", None) not in PROJECTION_OPS:
            return False
        projections += 1
        return projections % 2 == 0

    return recomputed


OpKey = tuple[Any, int]  # (aten op, how many times the block ran it before) within one forward

# torch hands the policy the op's output (SelectiveCheckpointContext.op_output) from 2.5 or so; where
# it does not, an extra dispatch mode (_OutputsSeen) shows the forward's matmul outputs instead.
POLICY_SEES_OUTPUTS = "op_output" in inspect.signature(torch_checkpoint.SelectiveCheckpointContext).parameters


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _tensors(item)]
    return []


def _storage_address(tensor: torch.Tensor) -> int:
    """Where the tensor's memory starts (shared by all its views); 0 where it has none to compare.

    A fake tensor (the simulated profiler) has no memory: 0, without asking (torch warns on it).
    """
    if isinstance(tensor, FakeTensor):
        return 0
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
        return 0


def _written(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``op`` writes into: the arguments its schema marks as written (``Tensor(a!)``)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    written: list[torch.Tensor] = []
    for index, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is not None and alias.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            written.extend(_tensors(value))
    return written


class _Mutations:
    """One forward's saved outputs, by storage, and the keys of those a later op wrote into."""

    def __init__(self) -> None:
        self.saved_at: dict[int, OpKey] = {}
        self.mutated: set[OpKey] = set()

    def saved(self, key: OpKey, output: Any) -> None:
        for tensor in _tensors(output):
            address = _storage_address(tensor)
            if address:
                self.saved_at[address] = key

    def wrote(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.saved_at:
            return
        for tensor in _written(op, args, kwargs):
            key = self.saved_at.get(_storage_address(tensor))
            if key is not None:
                self.mutated.add(key)


class _OutputsSeen(TorchDispatchMode):
    """Shows the policy's _Mutations the matmul outputs, where torch does not hand them to it."""

    def __init__(self, mutations: _Mutations, saved: set[OpKey]) -> None:
        super().__init__()
        self.mutations, self.saved_keys = mutations, saved
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        output = func(*args, **(kwargs or {}))  # runs through the caching mode, hence the policy
        if getattr(func, "overloadpacket", None) in MATMUL_OPS:
            key = (func, self.counts[func])
            self.counts[func] += 1
            if key in self.saved_keys:
                self.mutations.saved(key, output)
        return output


class _OpsReached(TorchDispatchMode):
    """Records which ops a recompute reaches (torch stops it once every saved tensor is back)."""

    def __init__(self, reached: set[OpKey]) -> None:
        super().__init__()
        self.reached = reached
        self.counts: dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.reached.add((func, self.counts[func]))
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


class SelectivePlan:
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

    def __init__(self, *, half: bool = False) -> None:
        self.half = half  # "selective-half": every second projection recomputed, no skip set learned
        self.skip: frozenset[OpKey] = frozenset()
        self.unchanged = 0  # recomputes in a row that left the plan as it was
        self.written_into: set[OpKey] = set()  # outputs a later in-place op overwrote: recomputed

    def contexts(self, saved: set[OpKey], reached: set[OpKey]) -> tuple[Any, Any]:
        counts: dict[Any, int] = defaultdict(int)
        skip = self.skip | self.written_into
        mutations = _Mutations()
        # The forward alone calls the policy (the recompute reads torch's record of its answers).
        alternate = every_second_projection() if self.half else None  # plain selective: no extra call

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch_checkpoint.CheckpointPolicy:
            key = (op, counts[op])
            counts[op] += 1
            mutations.wrote(op, args, kwargs)
            if alternate is not None and alternate(op):
                return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
            if getattr(op, "overloadpacket", None) in MATMUL_OPS and key not in skip:
                saved.add(key)
                if POLICY_SEES_OUTPUTS:
                    mutations.saved(key, ctx.op_output)
                return torch_checkpoint.CheckpointPolicy.MUST_SAVE
            return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(policy)
        forward = caching if POLICY_SEES_OUTPUTS else _stacked(caching, _OutputsSeen(mutations, saved))
        return forward, self._recompute(cached, mutations, reached)

    @contextlib.contextmanager
    def _recompute(self, cached: Any, mutations: _Mutations, reached: set[OpKey]) -> Iterator[None]:
        """Entered as backward reruns the block: answered from the cache unless the forward wrote
        into a cached output, in which case the cache is stale and every op is rerun."""
        self.written_into |= mutations.mutated
        answers = cached if not mutations.mutated else contextlib.nullcontext()
        if (self.half or self.unchanged >= self.STABLE_AFTER) and not mutations.mutated:
            with answers:
                yield
            return
        with answers, _OpsReached(reached):  # the recorder sees each op before the cache answers it
            yield

    def learn(self, saved: set[OpKey], reached: set[OpKey]) -> None:
        if self.half or not reached:  # torchtitan's policy as it runs; not recorded; ran nothing
            return
        skip = frozenset((self.skip | saved) - reached)
        self.unchanged = self.unchanged + 1 if skip == self.skip else 0
        self.skip = skip


@contextlib.contextmanager
def _stacked(*modes: Any) -> Iterator[None]:
    """Enter the modes in order: the last entered sees each op first."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield
