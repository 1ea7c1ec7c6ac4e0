"""MemoryTracker: peak live tensor memory on one device by category (parameters, gradients, ...)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError, UsageError
from ..trees.batches import op_tensors
from ..trees.modules import is_compiled
from .units import format_bytes

logger = logging.getLogger(__name__)

CATEGORIES = ("parameters", "gradients", "optimizer state", "saved activations", "temporaries", "other")
# The CUDA caching allocator hands out blocks in multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
# kMinBlockSize), so a CUDA storage of n bytes occupies ceil(n / 512) * 512 of them.
_CUDA_BLOCK_BYTES = 512


@dataclasses.dataclass
class _Storage:
    nbytes: int
    category: str
    seq: int  # allocation order; a storage with seq <= peak_seq that is still alive was alive at the peak
    ref: weakref.ref[torch.UntypedStorage]
    event: int = 0  # its number in allocation_events (from 1), when recorded


class _LiveStorageMode(TorchDispatchMode):
    """Sees every aten op: registers the storages of its inputs (first sight) and outputs (new)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        tracker = self.tracker
        for tensor in op_tensors(args):
            tracker._see_input(tensor)
        out = func(*args, **(kwargs or {}))
        for tensor in op_tensors(out):
            tracker._see_output(tensor)
        tracker._update_peak()
        return out


class MemoryTracker:
    """Peak live tensor bytes on one device over a ``with`` block, by category.

    The device: ``device`` when given, else the model's (or the optimizer's), else that of the first
    tensor an op inside the block uses.

    Every storage is counted once, however many tensors view it. Categories: parameters (with
    buffers), gradients (``.grad`` of parameters), optimizer state (tensors an optimizer keeps in
    ``optimizer.state`` after ``step()``), saved activations (tensors autograd saved for backward),
    temporaries (everything else made inside the block), other (tensors made before the block and
    first used inside it, such as the input batch).

    Pass ``model`` and ``optimizer`` so that their tensors count from the start, even those the block
    never touches; parameters used inside the block are found without it. Optimizers are seen
    through torch's global step hooks. On CUDA, ``cuda_max_allocated_bytes`` and
    ``cuda_max_reserved_bytes`` give the allocator's own peaks over the same span (the tracker resets
    CUDA's peak statistics when it starts).

    Limits: memory that never passes through an aten op's inputs or outputs (``UntypedStorage.resize_``,
    a kernel's private workspace) is not seen; CUDA storages are counted in 512-byte blocks as the
    caching allocator rounds them. A storage made during ``optimizer.step()`` counts as a temporary
    until the step ends and it is found in ``optimizer.state``; the breakdown at a peak inside the
    step is corrected then.

    torch.compile: the tracker is a TorchDispatchMode, under which dynamo does not compile, so a
    compiled model runs (and is measured) eagerly inside the block; on torch 2.13 a compiled module
    whose first call happens under the tracker may stay eager afterwards. Call it once before
    tracking. (``mb.plan`` profiles the eager module inside a compiled one and never calls it.)
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        record_allocations: bool = False,
    ) -> None:
        # Without device=, the model's (or the optimizer's) device; failing those, the device of the
        # first tensor the block uses. Never "the GPU because one exists": a CPU model on a GPU
        # machine is tracked on the CPU.
        self._device_from_first_tensor = False
        if device is None:
            device = _device_of(model, optimizer)
            self._device_from_first_tensor = device is None
        self.device = _resolved(torch.device(device) if device is not None else torch.device("cpu"))
        if model is not None and is_compiled(model):
            logger.warning(
                "MemoryTracker(model=<torch.compile'd module>): inside the tracker the model runs eagerly "
                "(dynamo does not compile under a dispatch mode); the peak is eager execution's"
            )
        self._model = model
        self._optimizer = optimizer
        # With record_allocations: n >= 0 for a storage of n bytes first seen, -k when the k-th is
        # freed (what microbatch.memory.allocator.replay takes, to state the peak in CUDA reserved bytes).
        self.allocation_events: list[int] | None = [] if record_allocations else None
        self._allocations = 0
        self.peak_bytes = 0
        self.breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.cuda_max_allocated_bytes: int | None = None
        self.cuda_max_reserved_bytes: int | None = None
        self._live: dict[int, _Storage] = {}
        self._totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._current_bytes = 0
        self._seq = 0
        self._peak_seq = 0
        self._step_start_seq: int | None = None
        self._thread: int | None = None  # the thread that entered the block (optimizer hooks are global)
        self._hooked_parameters: set[int] = set()
        # Set once a DTensor is seen (FSDP2): FSDP2 frees and refills its unsharded parameters'
        # storages with UntypedStorage.resize_, which no aten op shows, so before a new peak is taken
        # every live storage's size is read again.
        self._resizing = False
        self._handles: list[Any] = []
        self._stack: contextlib.ExitStack | None = None

    # -- public ---------------------------------------------------------------------------------

    @property
    def current_bytes(self) -> int:
        """Bytes of the storages alive now (at exit: those still alive after the block)."""
        return self._current_bytes

    def track(self, tensors: Any, *, category: str = "other") -> None:
        """Count tensors made before the block from the start (a tensor, or a list / tuple / dict)."""
        if category not in CATEGORIES:
            raise ConfigError(f"category={category!r} is not one of {', '.join(CATEGORIES)}")
        for tensor in op_tensors(tensors):
            self._register(tensor, category, recategorize=True)
        self._update_peak()

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "cuda_max_allocated_bytes": self.cuda_max_allocated_bytes,
            "cuda_max_reserved_bytes": self.cuda_max_reserved_bytes,
        }

    def __str__(self) -> str:
        lines = [f"peak live tensor memory on {self.device}: {format_bytes(self.peak_bytes)}"]
        for category in CATEGORIES:
            share = self.breakdown[category] / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"  {category:<18} {format_bytes(self.breakdown[category]):>11}  {share:6.1%}")
        if self.cuda_max_allocated_bytes is not None:
            lines.append(f"  cuda max allocated {format_bytes(self.cuda_max_allocated_bytes):>11}")
            lines.append(f"  cuda max reserved  {format_bytes(self.cuda_max_reserved_bytes or 0):>11}")
        return "\n".join(lines)

    def __enter__(self) -> MemoryTracker:
        if self._stack is not None:
            raise UsageError("this MemoryTracker is already active; use a new one for a nested span")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        stack = contextlib.ExitStack()
        self._thread = threading.get_ident()
        try:
            self._register_model_and_optimizer()
            self._update_peak()
            stack.callback(self._remove_hooks)
            self._handles.append(register_optimizer_step_pre_hook(self._before_step))
            self._handles.append(register_optimizer_step_post_hook(self._after_step))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
            stack.enter_context(_LiveStorageMode(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.cuda_max_allocated_bytes = int(torch.cuda.max_memory_allocated(self.device))
            self.cuda_max_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))

    # -- bookkeeping ----------------------------------------------------------------------------

    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        nbytes = int(storage.nbytes())
        if self.device.type == "cuda":
            nbytes = -(-nbytes // _CUDA_BLOCK_BYTES) * _CUDA_BLOCK_BYTES
        return nbytes

    def _on_device(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        # A DTensor (FSDP2's sharded parameters, gradients, optimizer state) is a wrapper whose own
        # storage claims the global size; this rank holds its local shard.
        local = getattr(tensor, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            tensor = local
            self._resizing = True
        device = tensor.device
        if self._device_from_first_tensor and device.type != "meta":
            self._device_from_first_tensor = False
            self.device = _resolved(device)
            if self.device.type == "cuda" and self._stack is not None:
                torch.cuda.reset_peak_memory_stats(self.device)
        if device.type != self.device.type or (
            self.device.index is not None and device.index is not None and device.index != self.device.index
        ):
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            return None
        return storage

    def _register(self, tensor: torch.Tensor, category: str, *, recategorize: bool) -> _Storage | None:
        storage = self._on_device(tensor)
        if storage is None:
            return None
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None:
            nbytes = self._storage_bytes(storage)
            if nbytes != entry.nbytes:  # resized in place (out= ops)
                self._totals[entry.category] += nbytes - entry.nbytes
                self._current_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes
            if recategorize and entry.category != category:
                self._move(entry, category)
            return entry
        nbytes = self._storage_bytes(storage)
        self._seq += 1
        entry = _Storage(nbytes, category, self._seq, weakref.ref(storage, self._freed_callback(key)))
        if self.allocation_events is not None:
            self.allocation_events.append(int(storage.nbytes()))
            self._allocations += 1
            entry.event = self._allocations
        self._live[key] = entry
        self._totals[category] += nbytes
        self._current_bytes += nbytes
        return entry

    def _freed_callback(self, key: int) -> Callable[[Any], None]:
        def freed(_: Any) -> None:
            entry = self._live.pop(key, None)
            if entry is not None and entry.event and self.allocation_events is not None:
                self.allocation_events.append(-entry.event)
            if entry is not None:
                self._totals[entry.category] -= entry.nbytes
                self._current_bytes -= entry.nbytes

        return freed

    def _move(self, entry: _Storage, category: str) -> None:
        self._totals[entry.category] -= entry.nbytes
        self._totals[category] += entry.nbytes
        entry.category = category

    def _update_peak(self) -> None:
        if self._current_bytes > self.peak_bytes and self._resizing:
            self._resync_sizes()
        if self._current_bytes > self.peak_bytes:
            self.peak_bytes = self._current_bytes
            self.breakdown = dict(self._totals)
            self._peak_seq = self._seq

    def _register_model_and_optimizer(self) -> None:
        parameters: list[torch.Tensor] = []
        if self._model is not None:
            parameters.extend(self._model.parameters())
            for buffer in self._model.buffers():
                self._register(buffer, "parameters", recategorize=True)
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                parameters.extend(group["params"])
            self._register_optimizer_state(self._optimizer)
        for parameter in parameters:
            self._register(parameter, "parameters", recategorize=True)
            self._hook_parameter(parameter)
            if parameter.grad is not None:
                self._register(parameter.grad, "gradients", recategorize=True)

    def _register_optimizer_state(self, optimizer: torch.optim.Optimizer) -> list[_Storage]:
        entries = []
        for state in optimizer.state.values():
            for tensor in op_tensors(state):
                entry = self._register(tensor, "optimizer state", recategorize=False)
                if entry is not None:
                    entries.append(entry)
        return entries

    def _hook_parameter(self, parameter: torch.Tensor) -> None:
        if not parameter.requires_grad or id(parameter) in self._hooked_parameters:
            return
        self._hooked_parameters.add(id(parameter))
        self._handles.append(parameter.register_post_accumulate_grad_hook(self._grad_accumulated))

    def _grad_accumulated(self, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self._register(parameter.grad, "gradients", recategorize=True)

    def _resync_sizes(self) -> None:
        """The current size of live storages, which resize_ may have freed or refilled since seen."""
        for entry in list(self._live.values()):
            storage = entry.ref()
            if storage is None:
                continue
            nbytes = self._storage_bytes(storage)
            if nbytes != entry.nbytes:
                self._totals[entry.category] += nbytes - entry.nbytes
                self._current_bytes += nbytes - entry.nbytes
                entry.nbytes = nbytes

    def _see_input(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, torch.nn.Parameter):
            self._register(tensor, "parameters", recategorize=False)
            self._hook_parameter(tensor)
        else:
            self._register(tensor, "other", recategorize=False)

    def _see_output(self, tensor: torch.Tensor) -> None:
        self._register(tensor, "temporaries", recategorize=False)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count a tensor autograd saves; keep it as a detached alias (same storage and version).

        Not the tensor itself: autograd saves some tensors that are outputs of the node saving them
        (relu, tanh, exp save their result), and such a tensor, held by its own grad_fn through the
        hook, makes a reference cycle through autograd's C++ graph that Python's collector cannot
        break. A graph never backpropagated (a forward under no loss.backward(), an exception or an
        OOM mid-forward) then stayed alive for good. A detached alias holds the storage without the
        grad_fn, as torch's own saving does for outputs.
        """
        if isinstance(tensor, torch.nn.Parameter):
            self._see_input(tensor)
            return tensor
        entry = self._register(tensor, "saved activations", recategorize=False)
        if entry is not None and entry.category in ("temporaries", "other"):
            self._move(entry, "saved activations")
        return tensor.detach()

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() == self._thread:  # torch's step hooks are global: every thread's
            self._step_start_seq = self._seq

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() != self._thread:  # another thread's optimizer is not this block's
            return
        peak_in_step = self._step_start_seq is not None and self._peak_seq > self._step_start_seq
        for entry in self._register_optimizer_state(optimizer):
            if entry.category == "optimizer state":
                continue
            # alive now and allocated before the peak => alive at the peak, in its old category
            if (
                peak_in_step
                and entry.seq <= self._peak_seq
                and self.breakdown[entry.category] >= entry.nbytes
            ):
                self.breakdown[entry.category] -= entry.nbytes
                self.breakdown["optimizer state"] += entry.nbytes
            self._move(entry, "optimizer state")
        self._step_start_seq = None

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked_parameters.clear()


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _device_of(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> torch.device | None:
    """The device of the model's first parameter or buffer, else of the optimizer's first parameter."""
    if model is not None:
        for tensor in [*model.parameters(), *model.buffers()]:
            return tensor.device
    if optimizer is not None:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                return torch.device(parameter.device)
    return None


def _resolved(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
