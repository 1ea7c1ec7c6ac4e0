"""Start `microbatch train` in a subprocess, signal it after some optimizer steps, collect the result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_TRAIN_SCRIPT = "import sys; import microbatch.cli as cli; sys.exit(cli.main(['train', *sys.argv[1:]]))"


def interrupt_train(
    args: list[str], run_dir: Path, sig: signal.Signals, *, after_steps: int
) -> tuple[int, str]:
    """Run ``microbatch train ARGS``; send ``sig`` once ``after_steps`` steps are logged.

    Returns the exit code and stderr.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, err
