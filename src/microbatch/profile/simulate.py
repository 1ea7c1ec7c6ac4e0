"""The profile without running kernels: the real profiler's runs under FakeTensorMode.

The model's parameters and buffers are swapped for fake tensors (shapes, dtypes and strides, no
memory; tied weights stay tied) and every micro-batch runs its forward and backward through
Accumulator.backward exactly as ``profile_workload`` runs it, under the same MemoryTracker (its
dispatch mode sees fake storages as it sees real ones, so the categories and the per-segment
kept / peak bytes are the same counting) and the same Recorder hooks, whose clock is a
``RooflineClock`` instead of ``time.perf_counter``. The fits, the slack and the Profile come from
the real profiler's own ``_assemble``: the solver and the search see no difference.

Values fake tensors do not have: ``.item()`` of an integer tensor (a count of items) reads as the
tensor's element count, of a boolean as True, of a float as 1.0; memory and time do not depend on
them. Batches are made for real by the workload (its ``make_batch``, with fake mode off) and
converted; nothing else allocates real memory.

For a CUDA target the tracker counts each storage in 512-byte blocks (``kMinBlockSize``), as
``memory_allocated`` does, and records the allocation sequence; as on a real GPU, each run's
sequence is replayed through ``microbatch.memory.allocator`` (block rounding, small and large pools,
segment sizes, splitting and fragmentation; ``expandable_segments`` when PYTORCH_CUDA_ALLOC_CONF
sets it), and the profile carries reserved minus live bytes (profile/reserved.py), so a plan's
predicted peak is reserved bytes. The CUDA context and the library workspaces, which the allocator
does not see, are the spec's ``context_bytes``, added as slack. Where a library picks its path by
the tensors' device (kernels, the optimizer's foreach, transformers' masks), a CUDA target takes
the path CUDA takes (profile/device_path.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from ..accumulate.accumulator import Accumulator
from ..checkpointing.api import BlockSpec, checkpoint
from ..memory import MemoryTracker
from ..memory.allocator import round_size
from ..memory.device_specs import DeviceSpec
from ..workload import Workload
from . import reserved
from .assemble import Measurements, assemble, gradient_bytes_by_segment
from .costs import NONE, Profile
from .device_path import cuda_path
from .measure import ProgressFn, _blocks_and_policies, default_micro_batch_sizes
from .roofline import RooflineClock
from .routing import simulated_routing, simulated_routing_note
from .runs import train_window
from .timeline import BEFORE, END, END_FORWARD, Recorder, Run, _Event, split

logger = logging.getLogger(__name__)


def _count(items: Any) -> Any:
    """A fake tensor count as a number: its value is unknown, and the Accumulator's checks of a
    tensor count (finite, whole, positive) would read fake flags. Memory and time do not depend on it."""
    return 1 if isinstance(items, torch.Tensor) else items


class _FakeScalars(TorchDispatchMode):
    """``.item()`` of a fake tensor: its element count (integers), True (booleans), 1.0 (floats)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            if tensor.dtype == torch.bool:
                return True
            if not tensor.is_floating_point() and not tensor.is_complex():
                return max(1, tensor.numel())
            return 1.0
        return func(*args, **(kwargs or {}))


class SimulatedTracker(MemoryTracker):
    """MemoryTracker over fake storages; with ``cuda``, counted in the allocator's 512-byte blocks
    (as MemoryTracker counts real CUDA storages) and with the allocations recorded for replay."""

    def __init__(self, *, cuda: bool, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__("cpu", model=model, optimizer=optimizer, record_allocations=cuda)
        self.cuda = cuda

    def _storage_bytes(self, storage: torch.UntypedStorage) -> int:
        nbytes = int(storage.nbytes())
        return round_size(nbytes) if self.cuda and nbytes else nbytes


class _ClockRecorder(Recorder):
    """The profiler's Recorder with the roofline clock in place of the wall clock."""

    def __init__(
        self, blocks: Sequence[tuple[str, nn.Module]], *, tracker: MemoryTracker, clock: RooflineClock
    ) -> None:
        super().__init__(blocks, tracker=tracker, device=torch.device("cpu"))
        self.clock = clock

    def mark(self, label: str) -> None:
        tracker = self.tracker
        live = peak = 0
        if tracker is not None:
            live, peak = tracker.current_bytes, tracker.peak_bytes
            tracker.peak_bytes = live
        if label in self.events:
            super().mark(label)  # raises the profiler's own error
        self.events[label] = _Event(self.clock.seconds, live, peak)


def _fake_of(tensor: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor like ``tensor``: converted from a real one, made afresh for a meta one."""
    if tensor.device.type != "meta":
        return mode.from_tensor(tensor.detach())
    with mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")


@contextlib.contextmanager
def fake_model(model: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Parameters and buffers of ``model`` replaced by fake ones for the ``with`` block, then restored.

    A tensor shared by several modules (tied weights) becomes one fake tensor shared alike. Meta
    tensors (a model built on the meta device) become fake CPU tensors.
    """
    fakes: dict[int, Any] = {}
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in fakes:
                    fake: Any = _fake_of(tensor, mode)
                    if isinstance(tensor, nn.Parameter):
                        fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    fakes[id(tensor)] = fake
                swapped.append((table, name, tensor))
                table[name] = fakes[id(tensor)]
    try:
        yield
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def fake_batch(workload: Workload, size: int, mode: FakeTensorMode) -> Any:
    """The workload's batch of ``size``, made for real (modes off), as fake tensors."""
    with _disable_current_modes():
        batch = workload.make_batch(size)
    return tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, batch)


@contextlib.contextmanager
def simulation(
    model: nn.Module, spec: DeviceSpec, *, tf32: bool = False
) -> Iterator[tuple[FakeTensorMode, RooflineClock]]:
    """Fake tensors for ``model``, fake scalars and the roofline clock, for the ``with`` block."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clock = RooflineClock(spec, tf32=tf32)
    device_path = cuda_path() if spec.kind == "cuda" else contextlib.nullcontext()
    with fake_model(model, mode), mode, _FakeScalars(), clock, device_path:
        yield mode, clock


def _window_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What Accumulator.step does around the optimizer: rescale the gradients once, take their norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0)
        nn.utils.get_total_norm(grads, foreach=True)
    optimizer.step()


def static_costs(
    model: nn.Module, optimizer: torch.optim.Optimizer, clock: RooflineClock, *, cuda: bool
) -> tuple[dict[str, int], int, float]:
    """Static bytes by category, the step's transient bytes and seconds, inside ``simulation``.

    As the real profiler after its first step: every trainable parameter has a gradient and the
    optimizer has made its state (one step on zero gradients creates the same tensors).
    """
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    with SimulatedTracker(cuda=cuda, model=model, optimizer=optimizer) as tracker:
        start_bytes = tracker.current_bytes
        static = dict(tracker.breakdown)
        began = clock.seconds
        _window_step(model, optimizer)
        seconds = clock.seconds - began
    for parameter in model.parameters():
        parameter.grad = None
    return static, reserved.step_peak_bytes(tracker, start_bytes), seconds


@dataclasses.dataclass
class _Runner:
    """Simulated forward and backward passes of one workload (measure._micro_batch under fakes)."""

    workload: Workload
    blocks: Sequence[tuple[str, nn.Module]]
    optimizer: torch.optim.Optimizer
    mode: FakeTensorMode
    clock: RooflineClock
    cuda: bool

    def run(self, size: int) -> Run:
        """One micro-batch of ``size``, cut into segments."""
        model, clock = self.workload.model, self.clock
        started = clock.seconds
        batch = fake_batch(self.workload, size, self.mode)
        accumulator = Accumulator(model, self.optimizer, steps=2)
        tracker = SimulatedTracker(cuda=self.cuda, model=model, optimizer=self.optimizer)
        recorder = _ClockRecorder(self.blocks, tracker=tracker, clock=clock)
        try:
            with tracker:
                recorder.mark(BEFORE)
                loss, items = self.workload.loss(model, batch)
                recorder.mark(END_FORWARD)
                recorder.in_backward = True
                accumulator.backward(loss, items=_count(items))
                recorder.mark(END)
                del loss, batch
        finally:
            recorder.close()
        return reserved.with_reserved_peak(split(recorder, recorder.order, started), tracker)

    def runs(
        self, policies: Sequence[str], sizes: Sequence[int], progress: ProgressFn | None
    ) -> tuple[dict[tuple[str, int], Run], dict[tuple[str, int], Run]]:
        """Per (policy, size): the steady-state run and a fresh checkpoint's first call."""
        steady: dict[tuple[str, int], Run] = {}
        first: dict[tuple[str, int], Run] = {}
        done, total = 0, len(policies) * len(sizes)
        for policy in policies:
            names = {name: policy for name, _ in self.blocks}
            handle = checkpoint(self.workload.model, policy=names) if policy != NONE else None
            try:
                for size in sizes:
                    if progress is not None:
                        progress(f"simulating policy {policy}, micro-batch {size}", done, total)
                    done += 1
                    first[policy, size] = self.run(size)
                    steady[policy, size] = self.run(size) if policy != NONE else first[policy, size]
            finally:
                if handle is not None:
                    handle.remove()
        return steady, first


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """The model in training mode inside, each module's own mode back afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, was_training in modes:
            module.training = was_training


def _handed_out(batches: list[Any]) -> Iterator[Any]:
    """The batches one by one, each dropped from the list as it is handed out (freed after use)."""
    while batches:
        yield batches.pop(0)


def _context_notes(device: DeviceSpec, model: nn.Module, moe_capacity_factor: float) -> list[str]:
    """The notes on what the simulation assumed: the CUDA context's allowance, an MoE's routing."""
    routing = simulated_routing_note(model, moe_capacity_factor)
    notes = [routing] if routing is not None else []
    if not device.context_bytes:
        return notes
    return [
        f"{device.name}: the CUDA context and library workspaces, which the allocator does not see, "
        f"are allowed {device.context_bytes / 1024**2:.0f} MiB (in the slack)",
        *notes,
    ]


def simulate_profile(
    workload: Workload,
    device: DeviceSpec,
    *,
    micro_batch_sizes: Sequence[int] | None = None,
    max_micro_batch_size: int = 16,
    blocks: BlockSpec = "auto",
    policies: Sequence[str] | None = None,
    tf32: bool = False,
    progress: ProgressFn | None = None,
    moe_capacity_factor: float = 1.0,
) -> Profile:
    """What ``profile_workload`` would measure on ``device``, predicted under fake tensors.

    Same sizes, blocks and policies as the real profiler (offload is left out: it moves tensors to
    the host, which a single simulated device does not model). The model is left as it was. A
    mixture of experts' routing is ``moe_capacity_factor``'s (profile/routing.py), stated in the notes.
    """
    began = time.perf_counter()
    model = workload.model
    sizes = sorted(set(micro_batch_sizes or default_micro_batch_sizes(max_micro_batch_size)))
    wanted = policies if policies is not None else (NONE, "full", "selective")
    found, chosen, notes = _blocks_and_policies(
        model, blocks, [p for p in wanted if p != "offload"], device.torch_device
    )
    cuda, routing = device.kind == "cuda", simulated_routing(model, moe_capacity_factor)
    with _training_mode(model), routing, simulation(model, device, tf32=tf32) as (mode, clock):
        model.zero_grad(set_to_none=True)
        optimizer = workload.make_optimizer()
        static, step_peak_bytes, step_seconds = static_costs(model, optimizer, clock, cuda=cuda)
        # The profiled runs hold every gradient, as from a window's second micro-batch on.
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.zeros_like(parameter)
        runner = _Runner(workload, found, optimizer, mode, clock, cuda)
        memory_runs, first_runs = runner.runs(chosen, sizes, progress)
        gradients = gradient_bytes_by_segment(model, found)
        model.zero_grad(set_to_none=True)
    notes.extend(_context_notes(device, model, moe_capacity_factor))
    measured = Measurements(
        sizes=sizes,
        policies=chosen,
        memory_runs=memory_runs,
        first_runs=first_runs,
        timed_runs={key: [run] for key, run in memory_runs.items()},
        static=static,
        optimizer_name=type(optimizer).__name__,
        step_peak_bytes=step_peak_bytes,
        step_seconds=step_seconds,
        gradient_bytes=gradients,
    )
    profile = assemble(
        workload, device.torch_device, measured, notes=notes, seconds=time.perf_counter() - began
    )
    return dataclasses.replace(
        profile,
        device=f"{device.name} (simulated)",
        slack_bytes=profile.slack_bytes + device.context_bytes,
    )


def simulate_window(
    workload: Workload,
    device: DeviceSpec,
    *,
    micro_batch_sizes: Sequence[int],
    policies: dict[str, str],
    tf32: bool = False,
) -> MemoryTracker:
    """The planner's trial window (planner.trial.run_trial) under fake tensors: its tracker.

    One optimizer step over micro-batches of ``micro_batch_sizes`` with ``policies`` per block,
    the optimizer's state created beforehand, as the real trial runs it. The model is left as it was.
    """
    model = workload.model
    training = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        with simulation(model, device, tf32=tf32) as (mode, _):
            optimizer = workload.make_optimizer()
            for parameter in model.parameters():
                if parameter.requires_grad:
                    parameter.grad = torch.zeros_like(parameter)
            optimizer.step()
            for parameter in model.parameters():
                parameter.grad = None
            chosen = {name: policy for name, policy in policies.items() if policy != NONE}
            handle = checkpoint(model, policy=chosen) if chosen else None
            try:
                batches = [fake_batch(workload, size, mode) for size in micro_batch_sizes]
                accumulator = Accumulator(model, optimizer, steps=len(batches))
                tracker = SimulatedTracker(cuda=device.kind == "cuda", model=model, optimizer=optimizer)
                with tracker:
                    train_window(workload, accumulator, _handed_out(batches), count=_count)
            finally:
                if handle is not None:
                    handle.remove()
                for parameter in model.parameters():
                    parameter.grad = None
    finally:
        for module, was_training in training:
            module.training = was_training
    return tracker
