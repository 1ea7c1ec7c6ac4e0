"""A host allocation that fails (ulimit -v, a container's limit) is a clear error naming the bytes,
the batch and the fix, not "internal error ... bug" (issue 35, item 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from microbatch.cli import main
from microbatch.workload import seed_linear

HUGE_BYTES = 2**46  # 64 TiB, beyond the host: the CPU allocator refuses it at once


def workload_with_huge_batches():  # type: ignore[no-untyped-def]
    workload = seed_linear()
    make = workload.make_batch

    def make_batch(size: int):  # type: ignore[no-untyped-def]
        if size > 64:  # the size verify asks for: one batch far beyond the host
            torch.empty(HUGE_BYTES, dtype=torch.uint8)
        return make(size)

    workload.make_batch = make_batch
    return workload


def workload_that_raises_memory_error():  # type: ignore[no-untyped-def]
    workload = seed_linear()

    def make_batch(size: int):  # type: ignore[no-untyped-def]
        raise MemoryError

    workload.make_batch = make_batch
    return workload


@pytest.mark.parametrize(
    ("factory", "shown"),
    [
        ("workload_with_huge_batches", "allocating 64.00 TiB"),
        ("workload_that_raises_memory_error", "MemoryError"),
    ],
)
def test_verify_says_the_host_ran_out_of_memory(
    factory: str, shown: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code = main(["verify", f"test_host_memory:{factory}", "--batch", "100"])
    err = capsys.readouterr().err.strip()
    line = err.splitlines()[-1]
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "host ran out of memory" in line and shown in line and "--batch 100" in line
    assert "Lower --batch" in line and "verify makes the whole batch at once" in line
    assert "bug" not in line and "Traceback" not in err
