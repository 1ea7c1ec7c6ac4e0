"""Run folders you can trust (issue 22): microbatch's or refused, one writer, history checked on resume.

The concurrency tests run real processes: a second ``microbatch train`` is refused while the first
holds the folder's lock, and a first run killed with SIGKILL leaves no stale lock.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from microbatch import cli
from microbatch.errors import ConfigError, TrainingError
from microbatch.training import TrainConfig, train
from microbatch.training.ownership import LOCK_FILE, MARKER_FILE, FolderLock, default_run_dir
from microbatch.training.signals import STOP_SIGNALS, StopFlag
from train_signals import interrupt_train

NANO = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--no-progress")
BASE = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=100)
_TRAIN_SCRIPT = "import sys; import microbatch.cli as cli; sys.exit(cli.main(['train', *sys.argv[1:]]))"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_train(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["train", *args])
    return code, capsys.readouterr().err


def clear_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.name != LOCK_FILE}


# ------------------------------------------------------------------- a folder that is not ours


@pytest.mark.parametrize("names", [["config.json", "notes.txt"], ["metrics.jsonl"], [".draft.tmp"]])
def test_a_folder_with_the_users_files_is_refused_and_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], names: list[str]
) -> None:
    for name in names:
        (tmp_path / name).write_text(f"the user's own {name}\n")
    before = snapshot(tmp_path)
    line = clear_error(*run_train(*NANO, "--steps", "1", "--out", str(tmp_path), capsys=capsys))
    assert f"(first: {sorted(names)[0]!r})" in line
    assert "--out" in line and "--resume" in line
    assert snapshot(tmp_path) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(names)  # no lock, no marker left


def test_an_empty_folder_is_used_and_marked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_train(*NANO, "--steps", "1", "--out", str(tmp_path), capsys=capsys)[0] == 0
    assert '"format": "microbatch-run-folder"' in (tmp_path / MARKER_FILE).read_text()
    assert '"version": 1' in (tmp_path / MARKER_FILE).read_text()


def test_resume_refuses_a_folder_with_a_checkpoint_copied_among_the_users_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, project = tmp_path / "run", tmp_path / "project"
    assert run_train(*NANO, "--steps", "1", "--out", str(run_dir), capsys=capsys)[0] == 0
    project.mkdir()
    (project / "checkpoint.pt").write_bytes((run_dir / "checkpoint.pt").read_bytes())
    (project / "config.json").write_text('{"mine": true}\n')
    (project / "notes.txt").write_text("my notes\n")
    before = snapshot(project)
    line = clear_error(*run_train("--resume", "--steps", "2", "--out", str(project), capsys=capsys))
    assert "not a microbatch run folder" in line
    assert snapshot(project) == before


def test_a_run_that_cannot_start_leaves_an_empty_folder_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--model", "gpt-nano", "--batch", "8", "--memory", "10KiB", "--no-progress")
    code, err = run_train(*args, "--out", str(tmp_path), capsys=capsys)
    clear_error(code, err)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------- one writer


def _start_long_run(run_dir: Path) -> subprocess.Popen[str]:
    args = [*NANO, "--steps", "100000", "--checkpoint-interval", "2", "--out", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT, *args], stderr=subprocess.PIPE, env=env, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if (run_dir / "checkpoint.pt").is_file():
            return process
        time.sleep(0.05)
    process.kill()
    raise AssertionError(process.communicate()[1])


@pytest.mark.slow
def test_a_second_writer_is_refused_with_the_holders_pid_and_kill_9_leaves_no_stale_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    first = _start_long_run(run_dir)
    try:
        began = time.monotonic()
        line = clear_error(*run_train(*NANO, "--steps", "3", "--out", str(run_dir), capsys=capsys))
        assert f"in use by another microbatch run (PID {first.pid})" in line
        line = clear_error(*run_train("--resume", "--steps", "3", "--out", str(run_dir), capsys=capsys))
        assert f"PID {first.pid}" in line
        assert time.monotonic() - began < 60  # refused at once, not after planning or training
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    # The kernel dropped the lock with the process: the run resumes at once.
    code, err = run_train("--resume", "--out", str(run_dir), "--steps", "4", capsys=capsys)
    assert code == 0, err


def test_the_lock_is_refused_across_processes_and_released_by_death(tmp_path: Path) -> None:
    script = (
        "import sys, time; from microbatch.training.ownership import FolderLock; "
        "lock = FolderLock(sys.argv[1], flag='--out'); print('held', flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
            FolderLock(str(tmp_path), flag="--out")
    finally:
        holder.kill()
        holder.wait()
    FolderLock(str(tmp_path), flag="--out").release()  # no stale lock after SIGKILL


def test_default_folder_names_never_collide(tmp_path: Path) -> None:
    root = str(tmp_path / "runs")
    names = [default_run_dir("gpt-nano", root=root) for _ in range(5)]
    assert len(set(names)) == 5 and all(os.path.isdir(name) for name in names)
    stamped = [name for name in names if name.endswith(("-2", "-3", "-4", "-5"))]
    # five names made within a second or two: at least three share a stamp and got a suffix
    assert len(stamped) >= 3, names


# ------------------------------------------------------------------- metrics.jsonl on resume


def _edited_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str]]:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "4", "--out", str(run_dir), capsys=capsys)[0] == 0
    return run_dir, (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)


EDITS: dict[str, Any] = {
    "line deleted": lambda lines: lines[:1] + lines[2:],
    "step duplicated": lambda lines: lines[:2] + lines[1:],
    "emptied": lambda lines: [],
    "stops early": lambda lines: lines[:3],
    "step abc": lambda lines: [lines[0].replace('"step": 1', '"step": "abc"'), *lines[1:]],
    "step null": lambda lines: [lines[0].replace('"step": 1', '"step": null'), *lines[1:]],
    "loss missing": lambda lines: [lines[0].replace('"loss"', '"lost"'), *lines[1:]],
    "not json": lambda lines: [lines[0], "{oops\n", *lines[1:]],
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_history_is_refused_on_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: str
) -> None:
    run_dir, lines = _edited_run(tmp_path, capsys)
    (run_dir / "metrics.jsonl").write_text("".join(EDITS[edit](lines)))
    before = snapshot(run_dir)
    line = clear_error(*run_train("--resume", "--steps", "6", "--out", str(run_dir), capsys=capsys))
    assert "does not match the checkpoint, which covers steps 1 to 4" in line
    assert snapshot(run_dir) == before


def test_invalid_utf8_in_the_history_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, lines = _edited_run(tmp_path, capsys)
    (run_dir / "metrics.jsonl").write_bytes(lines[0].encode() + b"\xff\xfe\n" + "".join(lines[1:]).encode())
    line = clear_error(*run_train("--resume", "--steps", "6", "--out", str(run_dir), capsys=capsys))
    assert "line 2 is not a JSON line (UnicodeDecodeError)" in line


def test_a_last_line_cut_short_by_a_kill_and_lines_past_the_checkpoint_are_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, lines = _edited_run(tmp_path, capsys)
    past = lines[3].replace('"step": 4', '"step": 5')
    (run_dir / "metrics.jsonl").write_text("".join(lines) + past + past[:20])
    assert run_train("--resume", "--steps", "6", "--out", str(run_dir), capsys=capsys)[0] == 0
    steps = [
        line.split('"step": ')[1].split(",")[0]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == ["1", "2", "3", "4", "5", "6"]


# ------------------------------------------------------------------- links and signals


def test_metrics_replaced_by_a_symlink_mid_run_is_not_written_through(tmp_path: Path) -> None:
    run_dir, victim = tmp_path / "r", tmp_path / "victim.txt"
    victim.write_text("precious\n")

    def swap(report: Any) -> None:
        if report.step == 1:
            (run_dir / "metrics.jsonl").unlink()
            (run_dir / "metrics.jsonl").symlink_to(victim)

    with pytest.raises(TrainingError, match="symbolic link"):
        train(dataclasses.replace(BASE, steps=3, out=str(run_dir)), progress=swap)
    assert victim.read_text() == "precious\n"


def test_the_session_signals_are_handled_and_an_ignored_one_stays_ignored() -> None:
    names = {signal.Signals(signum).name for signum in STOP_SIGNALS}
    assert {"SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU"} <= names
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with StopFlag().installed() as stop:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.requested and stop.signal_name == "SIGUSR1"
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.slow
def test_sighup_saves_and_exits_129(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    args = [*NANO, "--steps", "100000", "--checkpoint-interval", "100000", "--out", str(run_dir)]
    returncode, err = interrupt_train(args, run_dir, signal.SIGHUP, after_steps=2)
    assert returncode == 129, err
    assert "Traceback" not in err
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "summary.json").is_file()


DAMAGES = [
    ("step", -5, "step -5"),
    ("step", "abc", "step 'abc'"),
    ("ranks", [], "ranks"),
    ("plan", "x", "plan is str"),
]


@pytest.mark.parametrize(("field", "value", "said"), DAMAGES)
def test_a_damaged_checkpoint_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any, said: str
) -> None:
    import torch

    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "2", "--out", str(run_dir), capsys=capsys)[0] == 0
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state[field] = value
    torch.save(state, run_dir / "checkpoint.pt")
    line = clear_error(*run_train("--resume", "--steps", "3", "--out", str(run_dir), capsys=capsys))
    assert "is damaged" in line and said in line
