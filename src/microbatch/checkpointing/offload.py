"""The offload policy's copies: block inputs to host memory on a side stream, back ahead of backward.

A block checkpointed with policy="offload" saves only its inputs, and saves them here:

- pack (forward): on CUDA the copy to pinned host memory runs on a side stream (one per device)
  that first waits for the compute stream, so the copy overlaps the next block's forward. The
  device tensor is marked as in use by the side stream (``record_stream``), so the caching
  allocator does not hand its memory out again before the copy has read it.
- unpack (backward): the copy back runs on the side stream too and the compute stream waits
  for it with an event, not the host. Unpacking one block's input starts the copy back of the
  input that backward will need next (the previous offloaded block's, in forward order): a
  prefetch, so that copy overlaps this block's recompute and backward. At most one prefetched
  input is on the device beyond the one in use.

Pinned memory is decided by the tensor: pinned for a CUDA tensor, plain for anything else (a CPU
tensor on a machine with a GPU is not pinned). On other devices the copies are synchronous.
The alternative, ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, copies on the compute
stream and fetches each tensor only when backward reaches it, so its copies never overlap compute.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


class _Entry:
    """One saved tensor: its host copy, the event after which that copy is complete, and its way back."""

    __slots__ = ("__weakref__", "device", "device_copy", "fetched_event", "host", "packed_event")

    def __init__(self, device: torch.device, host: torch.Tensor, packed_event: Any) -> None:
        self.device = device
        self.host: torch.Tensor | None = host
        self.packed_event = packed_event
        self.device_copy: torch.Tensor | None = None
        self.fetched_event: Any = None


class HostOffload:
    """Pack / unpack hooks shared by the offloaded blocks of one thread (see the module docstring).

    ``prefetched`` and ``fetched_on_demand`` count the copies back that backward started ahead of
    need and those it had to wait for.
    """

    def __init__(self) -> None:
        self._entries: list[weakref.ref[_Entry]] = []  # in pack (forward) order
        self._streams: dict[torch.device, Any] = {}
        self.prefetched = 0
        self.fetched_on_demand = 0

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor, *, copy_host_tensors: bool = False) -> Any:
        if tensor.device.type == "cpu" and not copy_host_tensors:
            return tensor
        on_cuda = tensor.device.type == "cuda"
        host = torch.empty(
            tensor.size(), dtype=tensor.dtype, layout=tensor.layout, device="cpu", pin_memory=on_cuda
        )
        event = None
        if on_cuda:
            side = self._side_stream(tensor.device)
            side.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(side)
                event = side.record_event()
        else:
            host.copy_(tensor)
        entry = _Entry(tensor.device, host, event)
        self._entries = [ref for ref in self._entries if ref() is not None]
        self._entries.append(weakref.ref(entry))
        return entry

    def _fetch(self, entry: _Entry) -> None:
        """Start the copy back of ``entry`` (on the side stream on CUDA)."""
        host = entry.host
        if host is None or entry.device_copy is not None:
            return
        if entry.device.type == "cuda":
            side = self._side_stream(entry.device)
            with torch.cuda.stream(side):
                side.wait_event(entry.packed_event)
                entry.device_copy = host.to(entry.device, non_blocking=True)
                entry.fetched_event = side.record_event()
        else:
            entry.device_copy = host.to(entry.device, copy=True)

    def _previous(self, entry: _Entry) -> _Entry | None:
        """The entry packed just before ``entry`` that is still waiting on the host."""
        previous = None
        for ref in self._entries:
            candidate = ref()
            if candidate is entry:
                return previous
            if candidate is not None and candidate.host is not None and candidate.device_copy is None:
                previous = candidate
        return None

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        entry: _Entry = packed
        if entry.device_copy is None:
            if entry.host is None:
                raise RuntimeError(
                    "an offloaded tensor was unpacked twice; backward ran twice over one graph"
                )
            self.fetched_on_demand += 1
            self._fetch(entry)
        tensor = entry.device_copy
        if tensor is None:  # _fetch has set it; a failure here is microbatch's bug, not the user's
            raise RuntimeError("internal error: an offloaded tensor was unpacked before its copy back began")
        if entry.device.type == "cuda":
            current = torch.cuda.current_stream(entry.device)
            current.wait_event(entry.fetched_event)
            tensor.record_stream(current)
        entry.device_copy, entry.host = None, None
        upcoming = self._previous(entry)
        if upcoming is not None:
            self.prefetched += 1
            self._fetch(upcoming)
        return tensor


_LOCAL = threading.local()


def thread_offload() -> HostOffload:
    """The HostOffload shared by this thread's offloaded blocks (so backward can prefetch across them)."""
    offload = getattr(_LOCAL, "offload", None)
    if offload is None:
        offload = _LOCAL.offload = HostOffload()
    return offload


def saved_on_host(*, copy_host_tensors: bool = False) -> torch.autograd.graph.saved_tensors_hooks:
    """Hooks that keep the tensors saved under them in host memory (see the module docstring).

    Host tensors stay as they are unless ``copy_host_tensors`` (tests use it to run the round trip
    and the prefetch order on the CPU).
    """
    offload = thread_offload()
    return torch.autograd.graph.saved_tensors_hooks(
        lambda tensor: offload.pack(tensor, copy_host_tensors=copy_host_tensors), offload.unpack
    )
