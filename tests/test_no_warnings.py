"""train, plan, verify and every example print no warning (issue 25, point 7).

Each runs with every warning shown (``-W always`` / ``simplefilter("always")``); any warning fails
the test with its text and where it was raised. Third-party deprecations that microbatch's own calls
used to trigger (transformers' is_gradient_checkpointing, peft's fan_in_fan_out) are among them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from microbatch.cli import main

ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_SECONDS = 1800  # not a speed limit: each run takes seconds to a minute
# Every example runs (a new one with its defaults); these get smaller sizes.
ARGUMENTS = {
    "accelerate_loop.py": ["--cpu"],
    "finetune_gpt2.py": ["--windows", "2"],
    "contrastive_finetune.py": ["--batch", "32", "--fits", "8", "--steps", "2"],
}
EXAMPLES = {path.name: ARGUMENTS.get(path.name, []) for path in sorted((ROOT / "examples").glob("*.py"))}
COMMANDS = {
    "train": ["train", "--model", "gpt-nano", "--batch", "8", "--micro-batch", "4", "--steps", "2"],
    "plan": ["plan", "gpt-nano", "--batch", "8", "--memory", "3MiB"],
    "plan-lora": [
        "plan", "gpt2", "--device", "rtx4090", "--lora-rank", "4", "--batch", "4", "--seq-len", "64",
        "--memory", "23GiB",
    ],
    "verify": ["verify", "seed-linear", "--batch", "8", "--steps", "2"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_command_warns_nothing(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if name == "plan-lora":
        pytest.importorskip("peft", reason="the LoRA plan needs peft")
        pytest.importorskip("transformers", reason="the LoRA plan needs transformers")
    monkeypatch.chdir(tmp_path)  # train's run folder lands here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(COMMANDS[name]) == 0, capsys.readouterr().err
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert not shown, "\n".join(shown)


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_the_example_warns_nothing(example: str, tmp_path: Path) -> None:
    source = (ROOT / "examples" / example).read_text()
    for module in ("accelerate", "lightning", "transformers"):
        if f"import {module}" in source or f"from {module}" in source:
            pytest.importorskip(module, reason=f"{example} needs {module}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-W", "always", str(ROOT / "examples" / example), *EXAMPLES[example]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=HANG_GUARD_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert not warned, "\n".join(warned)
