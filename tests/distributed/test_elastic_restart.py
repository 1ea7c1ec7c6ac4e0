"""torchrun's own fault tolerance (issue 35): a rank killed mid-run under ``torchrun --max-restarts 1``
and the run completes by itself, resuming from its last checkpoint, with the losses of a run nobody
disturbed (bitwise on CPU: the windows after the checkpoint run again from the same state).

Both runs are real ``torchrun --standalone`` launches of ``microbatch train``; rank 1 is found by
its LOCAL_RANK among the launcher's workers and sent SIGKILL once step 4 is logged (during window 5).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ARGS = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--steps", "10", "--no-progress")


def _torchrun(run_dir: Path, extra: tuple[str, ...]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "-m", "microbatch", "train", *ARGS, "--checkpoint-interval", "3",
        "--out", str(run_dir), *extra,
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _local_rank_one(launcher: int) -> int | None:
    """The PID of the launcher's worker with LOCAL_RANK=1 (Linux /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher and b"LOCAL_RANK=1" in environ:
            return int(entry)
    return None


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank through /proc")
@pytest.mark.parametrize("extra", [(), ("--pipeline", "2")], ids=["ddp", "pipeline-2-stages"])
def test_a_rank_killed_mid_window_under_max_restarts_resumes_by_itself(
    tmp_path: Path, extra: tuple[str, ...]
) -> None:
    reference = _torchrun(tmp_path / "reference", extra)
    _out, err = reference.communicate(timeout=400)
    assert reference.returncode == 0, err[-3000:]
    run_dir = tmp_path / "killed"
    launch = _torchrun(run_dir, extra)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and launch.poll() is None and _steps_logged(run_dir) < 4:
            time.sleep(0.01)
        victim = _local_rank_one(launch.pid)
        assert victim is not None and _steps_logged(run_dir) < 10
        os.kill(victim, signal.SIGKILL)
        _out, err = launch.communicate(timeout=400)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert launch.returncode == 0, err[-3000:]
    assert "torchrun restart 1: resuming the run" in err
    assert "This is a bug" not in err and "internal error" not in err
    assert _losses(run_dir) == _losses(tmp_path / "reference")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 10 and summary["resumed_from_step"] in (3, 6, 9)
