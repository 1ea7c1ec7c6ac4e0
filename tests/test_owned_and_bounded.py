"""Trackers and temporaries that belong to their caller; huge sizes and misuse refused at once (issue 22)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import microbatch as mb
from microbatch import cli
from microbatch.accumulate.cached import cached_backward
from microbatch.errors import ConfigError
from microbatch.hf.configs import architecture_config
from microbatch.profile import stash

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tracked_peak(other_thread_steps: bool) -> int:
    """Thread A's tracked peak for a small SGD step while thread B (maybe) steps a big, untracked Adam."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    big = [torch.nn.Parameter(torch.randn(1024, 1024))]
    big_optimizer = torch.optim.Adam(big, lr=0.1)
    entered, stepped = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        big[0].grad = torch.ones_like(big[0])
        big_optimizer.step()  # creates 8 MiB of Adam state in another thread
        stepped.set()

    worker = threading.Thread(target=other)
    worker.start()
    with mb.MemoryTracker(model=model, optimizer=optimizer) as tracker:
        model(torch.randn(4, 16)).sum().backward()
        entered.set()
        if other_thread_steps:
            stepped.wait()
        optimizer.step()
    entered.set()
    worker.join()
    return tracker.peak_bytes


def test_memory_tracker_counts_only_its_own_threads_optimizer_steps() -> None:
    alone = _tracked_peak(other_thread_steps=False)
    assert _tracked_peak(other_thread_steps=True) == alone
    assert alone < 1024 * 1024  # a Linear(16, 16) step: kilobytes, never B's 8 MiB of Adam state


def test_stale_stash_files_of_dead_processes_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"microbatch-stash-{dead.pid}-abc.pt"
    alive = tmp_path / f"microbatch-stash-{os.getppid()}-abc.pt"
    users = tmp_path / "microbatch-stash-notes.pt"
    for path in (stale, alive, users):
        path.write_bytes(b"x")
    model = torch.nn.Linear(4, 4)
    with stash.preserved(model), torch.no_grad():
        model.weight.add_(1.0)
    assert not stale.exists() and alive.exists() and users.exists()
    assert not list(tmp_path.glob(f"microbatch-stash-{os.getpid()}-*.pt"))  # this process's own: gone


def test_sigterm_while_a_stash_exists_removes_it(tmp_path: Path) -> None:
    script = (
        "import time, torch; from microbatch.profile import stash\n"
        "model = torch.nn.Linear(256, 256)\n"
        "with stash.preserved(model):\n"
        "    print('stashed', flush=True); time.sleep(600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "stashed"
    assert list(tmp_path.glob("microbatch-stash-*.pt"))
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143
    assert not list(tmp_path.glob("microbatch-stash-*.pt"))


def test_a_full_tmpdir_is_reported_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    with (
        pytest.raises(OSError, match="set TMPDIR to a folder with room"),
        stash.preserved(torch.nn.Linear(64, 64)),
    ):
        pass


@pytest.mark.parametrize("memory", ["1e400GiB", "1e30"])
def test_huge_memory_is_refused_naming_the_limit(memory: str) -> None:
    with pytest.raises(ConfigError, match="more than any machine has"):
        mb.parse_bytes(memory)


def test_a_batch_no_machine_can_hold_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    began = time.perf_counter()
    code = cli.main(["train", "--model", "gpt-nano", "--batch", str(10**12), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "at most --batch" in err.strip().splitlines()[-1]
    assert time.perf_counter() - began < 30  # before any profiling (70 s before the check)
    assert not (tmp_path / "r").exists()


def test_errors_inside_the_standard_library_are_not_blamed_on_the_user(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--timeout", "nan"]) == 2
    assert "--timeout must be a positive, finite number" in capsys.readouterr().err
    began = time.perf_counter()
    assert cli.main(["bench", "--output", "/proc/nope/RESULTS.md", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--output" in err and "error in your code" not in err
    assert time.perf_counter() - began < 30  # checked before any suite runs
    assert not cli._is_library(str(tmp_path / "user_code.py"))
    assert cli._is_library(json.__file__)


def test_a_config_json_with_absurd_sizes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10**9, "hidden_size": 64}))
    with pytest.raises(ConfigError, match="field num_hidden_layers is 1000000000"):
        architecture_config(str(path))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        architecture_config(str(fifo))


def test_cached_backward_on_an_empty_batch_is_a_user_error() -> None:
    with pytest.raises(ConfigError, match="empty batch"):
        cached_backward(torch.nn.Linear(2, 2), torch.zeros(0, 2), lambda r: r.sum(), micro_batch_size=2)
