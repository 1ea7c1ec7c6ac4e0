"""No host sync per micro-batch: counts given as tensors are read once per window.

``aten._local_scalar_dense`` is the op behind ``.item()``, ``int(t)`` and ``float(t)`` on a
tensor: on CUDA it makes the host wait for the device. A TorchDispatchMode counts it around each
micro-batch's forward + backward (expected: none) and around each step() (expected: at most two,
the window's counts in one read and the gradient norm). On the CPU the same op runs, so the count
proves on CPU what a GPU run would do. Gradients stay exact (float64, tolerance 1e-12).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from microbatch import Accumulator
from microbatch.errors import ConfigError
from microbatch.models.gpt import GPTConfig
from microbatch.models.workloads import gpt_workload

MAX_READS_PER_WINDOW = 2


class ScalarReads(TorchDispatchMode):
    """Counts the ops that copy one value of a tensor to the host, except those made by a package
    named in ``outside`` (code microbatch does not own)."""

    def __init__(self, *, outside: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.count = 0
        self.outside = tuple(f"{os.sep}{name}{os.sep}" for name in outside)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and not self._from_outside():
            self.count += 1
        return func(*args, **(kwargs or {}))

    def _from_outside(self) -> bool:
        return bool(self.outside) and any(
            marker in frame.filename for frame in traceback.extract_stack() for marker in self.outside
        )


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 4, dtype=torch.float64, generator=generator)
    y = torch.randn(12, 3, dtype=torch.float64, generator=generator)
    mask = torch.rand(12, 3, generator=generator) > 0.3  # items: the unmasked targets
    mask[:, 0] = True
    return x, y, mask


def _masked_mean(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor
) -> tuple[Any, Any]:
    items = mask.sum()
    return ((model(x) - y) ** 2 * mask).sum() / items, items


def test_backward_and_iterate_read_counts_once_per_window() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    reference = torch.nn.Linear(4, 3).double()
    reference.load_state_dict(model.state_dict())
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1.0), steps=3)
    x, y, mask = _data(1)
    micro = [(x[i : i + 4], y[i : i + 4], mask[i : i + 4]) for i in (0, 4, 8)] * 2  # two windows
    per_micro, per_window = [], []
    with ScalarReads() as reads:
        for item in acc.iterate(micro):
            before = reads.count
            loss, items = _masked_mean(model, *item.batch)
            acc.backward(loss, items=items)
            per_micro.append(reads.count - before)
            if item.is_last:
                before = reads.count
                stats = acc.step()
                per_window.append(reads.count - before)
    assert per_micro == [0] * 6
    assert len(per_window) == 2 and max(per_window) <= MAX_READS_PER_WINDOW
    assert stats.items == int(mask.sum())
    # The same two full-batch SGD steps on the reference (lr = 1): the gradient is exact.
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0)
    for _ in range(2):
        optimizer.zero_grad()
        _masked_mean(reference, x, y, mask)[0].backward()
        optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bad_tensor_counts_are_refused_when_the_window_ends() -> None:
    model = torch.nn.Linear(4, 1).double()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    x = torch.randn(2, 4, dtype=torch.float64)
    acc.backward(model(x).mean(), items=torch.tensor(2))
    acc.backward(model(x).mean(), items=torch.tensor(-1))
    with pytest.raises(ConfigError, match="negative, not finite or not a whole"):
        acc.step()
    assert model.weight.grad is None and acc._state.micro_batches == 0  # the window was discarded


def _reads_per_micro_batch(
    workload: Any, *, micro_batches: int = 3, size: int = 2, outside: tuple[str, ...] = ()
) -> list[int]:
    model = workload.model
    acc = Accumulator(model, workload.make_optimizer(), steps=micro_batches)
    batches = [workload.make_batch(size) for _ in range(micro_batches)]
    counts = []
    with ScalarReads(outside=outside) as reads:
        for item in acc.iterate(batches):
            before = reads.count
            loss, items = workload.loss(model, item.batch)
            acc.backward(loss, items=items)
            counts.append(reads.count - before)
            if item.is_last:
                acc.step()
    return counts


def test_builtin_gpt_workload_has_no_host_sync_per_micro_batch() -> None:
    config = GPTConfig(block_size=16, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
    assert _reads_per_micro_batch(gpt_workload(config, max_bytes=20_000)) == [0, 0, 0]


def test_hf_workload_has_no_host_sync_per_micro_batch() -> None:
    pytest.importorskip("transformers")
    from microbatch.hf.tiny import tiny_gpt2_workload

    # transformers' own SDPA mask builder reads the padding mask (masking_utils._ignore_causal_mask_sdpa,
    # twice per forward when an attention_mask is given): that is transformers', not microbatch's.
    assert _reads_per_micro_batch(tiny_gpt2_workload(), outside=("transformers",)) == [0, 0, 0]


def test_control_numbers_travel_on_a_gloo_group_beside_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an NCCL-only default group the control all_reduce goes to a gloo group on CPU tensors
    (made once), never to a CUDA tensor on whatever device happens to be current."""
    import torch.distributed as dist

    from microbatch.distributed import collectives

    made: list[str] = []
    reduced: list[tuple[torch.device, object]] = []
    monkeypatch.setattr(collectives, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(
        dist, "new_group", lambda backend=None, **_: made.append(backend) or f"group-{backend}"
    )
    monkeypatch.setattr(
        dist, "all_reduce", lambda tensor, op=None, group=None: reduced.append((tensor.device, group))
    )
    monkeypatch.setattr(collectives, "_CONTROL_GROUPS", {})
    for _ in range(3):
        assert collectives.all_reduce_values([1.0, 2.0]) == [1.0, 2.0]
    assert made == ["gloo"]
    assert reduced == [(torch.device("cpu"), "group-gloo")] * 3
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    collectives.all_reduce_values([1.0])
    assert reduced[-1] == (torch.device("cpu"), None)  # the default group serves CPU tensors
