"""Launching a function on N local processes in one gloo group: for tests and benchmarks, not for users
(who launch with torchrun)."""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..errors import ConfigError

logger = logging.getLogger(__name__)

ParallelKind = Literal["ddp", "fsdp"]


# ---------------------------------------------------------------------- launching (tests, benchmarks)


def _launched_main(
    rank_index: int,
    world: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_dir: str,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank_index),
            "LOCAL_RANK": str(rank_index),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    torch.set_num_threads(1)
    path = os.path.join(result_dir, f"rank{rank_index}.pt")
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank_index, world_size=world, timeout=timeout)
        try:
            result: dict[str, Any] = {"result": fn(*args)}
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, path)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes in one process group; return the results.

    For tests and benchmarks: the processes are spawned, meet on 127.0.0.1 at a port the OS picks
    (a TCPStore held by this process, so no other program can take the port in between), get the
    env:// variables torchrun would set, and use one CPU thread each. ``fn`` must be importable
    (a module-level function; a script calling launch() needs the
    ``if __name__ == "__main__":`` guard) and its result picklable by ``torch.save``. If a rank raises, the
    others are stopped and a RuntimeError carries that rank's traceback; past ``timeout_s`` all are
    stopped and TimeoutError says which ranks were still running (a hang becomes a failure).
    """
    import multiprocessing

    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    # The parent serves the rendezvous store; port 0 asks the OS for a free port.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="microbatch-launch-") as result_dir:
        processes = [
            context.Process(
                target=_launched_main,
                args=(r, world_size, store.port, backend, timeout_s, fn, tuple(args), result_dir),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            _wait(processes, result_dir, timeout_s)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
            for process in processes:
                process.join(5.0)
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for r in range(world_size):
            path = os.path.join(result_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                code = processes[r].exitcode
                raise RuntimeError(f"rank {r} of {world_size} exited (code {code}) without a result")
            outcome = torch.load(path, weights_only=False)
            if "error" in outcome:
                raise RuntimeError(f"rank {r} of {world_size} failed:\n{outcome['error']}")
            results.append(outcome["result"])
    del store
    return results


def _wait(processes: Sequence[Any], result_dir: str, timeout_s: float) -> None:
    """Wait for every process; stop early when one has failed (the others may be stuck in a collective)."""
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, bool] = {}  # rank -> failed, for the ranks that have exited
    failed_at: float | None = None
    while any(p.is_alive() for p in processes):
        now = time.monotonic()
        if now > deadline:
            running = [r for r, p in enumerate(processes) if p.is_alive()]
            raise TimeoutError(f"ranks {running} still running after {timeout_s:g} s (a hang?); stopped them")
        for r, process in enumerate(processes):
            if r not in outcome and not process.is_alive():
                outcome[r] = _failed(process, os.path.join(result_dir, f"rank{r}.pt"))
                if outcome[r] and failed_at is None:
                    failed_at = now
        if failed_at is not None and now - failed_at > 5.0:
            return  # a rank failed 5 s ago: the caller stops the others, which may wait on it forever
        time.sleep(0.02)


def _failed(process: Any, path: str) -> bool:
    if process.exitcode != 0 or not os.path.exists(path):
        return True
    return "error" in torch.load(path, weights_only=False)
