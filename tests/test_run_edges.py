"""Nothing lost at the run's edges (issue 35): one writer whatever happens to the lock file, and a
run folder renamed or replaced by a link mid-run never redirects a write.

The second writers are real ``microbatch train`` processes started while the first run trains
(from its progress callback, so the moment is exact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from microbatch import cli
from microbatch.errors import ResumeError, TrainingError
from microbatch.training import TrainConfig, train
from microbatch.training.ownership import LOCK_FILE

NANO = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--no-progress")
BASE = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=100)
_TRAIN_SCRIPT = "import sys; import microbatch.cli as cli; sys.exit(cli.main(['train', *sys.argv[1:]]))"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train_process(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", _TRAIN_SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300
    )


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_deleted_lock_file_lets_no_second_writer_in_and_the_first_runs_metrics_stay_intact(
    tmp_path: Path,
) -> None:
    run_dir, reference_dir = tmp_path / "r", tmp_path / "reference"
    refused: dict[str, subprocess.CompletedProcess[str]] = {}

    def attack(report: Any) -> None:
        if report.step == 1:  # before the first checkpoint: a second new run
            (run_dir / LOCK_FILE).unlink()
            refused["new, before the first checkpoint"] = train_process(
                *NANO, "--steps", "3", "--out", str(run_dir)
            )
        if report.step == 4:  # after the checkpoint of step 3: a resume, then a new run
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            refused["resume"] = train_process("--resume", "--steps", "9", "--out", str(run_dir))
            refused["new, after a checkpoint"] = train_process(*NANO, "--steps", "3", "--out", str(run_dir))

    config = dataclasses.replace(BASE, steps=6, checkpoint_interval=3)
    summary = train(dataclasses.replace(config, out=str(run_dir)), progress=attack)
    assert len(refused) == 3
    for what, result in refused.items():
        assert result.returncode == 2, (what, result.stderr)
        assert "Traceback" not in result.stderr, what
        assert "is in use by another microbatch run" in result.stderr, (what, result.stderr)
    # The first run's history: each step once, in order, the same losses as a run nobody disturbed.
    assert summary.steps_done == 6 and metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    train(dataclasses.replace(config, out=str(reference_dir)))
    assert losses(run_dir) == losses(reference_dir)
    # The locks went with the first run: it resumes at once.
    train(dataclasses.replace(config, steps=7, out=str(run_dir), resume=True))
    assert metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6, 7]


def test_a_folder_renamed_and_replaced_by_a_link_mid_run_is_never_written_through(tmp_path: Path) -> None:
    run_dir, moved, victim = tmp_path / "r", tmp_path / "moved", tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious\n")

    def swap(report: Any) -> None:
        if report.step == 2:
            run_dir.rename(moved)
            run_dir.symlink_to(victim, target_is_directory=True)

    config = dataclasses.replace(BASE, steps=6, checkpoint_interval=100)
    with pytest.raises(TrainingError) as raised:
        train(dataclasses.replace(config, out=str(run_dir)), progress=swap)
    message = str(raised.value)
    assert "moved or replaced" in message and str(moved) in message
    assert "last checkpoint is step 3" in message and "No checkpoint was saved yet" not in message
    assert sorted(path.name for path in victim.iterdir()) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "precious\n"
    # Everything went into the run's own folder, wherever it is now: it resumes from there.
    assert metrics_steps(moved) == [1, 2, 3]
    train(dataclasses.replace(config, out=str(moved), resume=True))
    assert metrics_steps(moved) == [1, 2, 3, 4, 5, 6]


def test_a_folder_deleted_mid_run_stops_the_run_saying_so(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"

    def delete(report: Any) -> None:
        if report.step == 1:
            for path in run_dir.iterdir():
                path.unlink()
            run_dir.rmdir()

    with pytest.raises(TrainingError, match="was deleted while the run trained"):
        train(dataclasses.replace(BASE, steps=4, out=str(run_dir)), progress=delete)
    assert not run_dir.exists()


# ------------------------------------------------------------------- output never costs training


def _train_into(stdout: Any, stderr: Any, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT, *args], stdout=stdout, stderr=stderr, env=env, text=True
    )


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_progress_and_summary_on_a_full_disk_do_not_stop_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    args = (*NANO[:-1], "--steps", "6", "--out", str(run_dir))  # with the progress line
    with open("/dev/full", "w") as full:  # every write: ENOSPC
        process = _train_into(full, full, *args)
        assert process.wait(timeout=300) == 0
    assert metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_hang_up_whose_terminal_is_gone_exits_129_with_the_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    args = (*NANO, "--steps", "100000", "--checkpoint-interval", "100000", "--out", str(run_dir))
    with open("/dev/full", "w") as full:  # the terminal is gone: every write of the run fails
        process = _train_into(full, full, *args)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and process.poll() is None:
                if (run_dir / "metrics.jsonl").is_file() and metrics_steps(run_dir)[-1:] >= [2]:
                    break
                time.sleep(0.05)
            process.send_signal(signal.SIGHUP)
            assert process.wait(timeout=120) == 129
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["stopped_by"] == "SIGHUP"
    assert summary["steps_done"] == metrics_steps(run_dir)[-1] >= 2


# ------------------------------------------------------------------- saved state proves itself


def _finished_run(tmp_path: Path) -> tuple[Path, TrainConfig]:
    run_dir = tmp_path / "r"
    config = dataclasses.replace(BASE, steps=3, out=str(run_dir))
    train(config)
    return run_dir, dataclasses.replace(config, steps=4, resume=True)


def test_one_flipped_bit_inside_a_tensor_of_the_checkpoint_is_refused_naming_the_file(tmp_path: Path) -> None:
    run_dir, resume = _finished_run(tmp_path)
    path = run_dir / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    weight = next(iter(state["model"].values())).contiguous()
    raw = bytearray(path.read_bytes())
    at = raw.find(weight.view(-1).view(torch.uint8).numpy().tobytes()[:64])
    assert at > 0  # torch.save stores tensors' bytes as they are
    raw[at + 17] ^= 0x04  # one bit of one parameter
    path.write_bytes(bytes(raw))
    assert torch.load(path, weights_only=True)["step"] == 3  # torch reads it without a word
    with pytest.raises(ResumeError, match=r"damaged.*checksum") as raised:
        train(resume)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("items", -500, "items -500 is not a non-negative count"), ("loss", 1.25, "checksum")],
)
def test_an_edited_metrics_record_is_refused_on_resume(
    tmp_path: Path, field: str, value: Any, said: str
) -> None:
    run_dir, resume = _finished_run(tmp_path)
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1][field] = value
    records[1]["tokens_per_second"] = records[1]["items"] / records[1]["seconds"]  # a careful edit
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    with pytest.raises(ResumeError, match=said) as raised:
        train(resume)
    assert str(path) in str(raised.value)


# ------------------------------------------------------------------- signals while planning


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGUSR1", "SIGUSR2", "SIGXCPU"])
def test_a_stop_signal_while_planning_leaves_no_stash_marker_or_lock(tmp_path: Path, name: str) -> None:
    run_dir, scratch = tmp_path / "r", tmp_path / "tmp"
    scratch.mkdir()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
        "TMPDIR": str(scratch),
    }
    args = ("--model", "gpt-nano", "--batch", "8", "--steps", "2", "--no-progress", "--out", str(run_dir))
    process = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT, *args], stderr=subprocess.PIPE, env=env, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if list(scratch.glob("microbatch-stash-*.pt")):  # the planner is profiling the model
                break
            time.sleep(0.002)
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(getattr(signal, name))
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + getattr(signal, name), err
    assert not list(scratch.glob("microbatch-stash-*.pt"))
    assert not run_dir.exists()  # the new run's folder, marker and lock: removed with it


def test_a_stash_left_by_a_killed_process_is_removed_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"microbatch-stash-{dead.pid}-abc.pt"
    stale.write_bytes(b"x")
    train(dataclasses.replace(BASE, steps=1, out=str(tmp_path / "r")))  # --micro-batch: no planner stash
    assert not stale.exists()


def test_resume_with_a_plan_of_a_micro_batch_run_says_what_is_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert cli.main(["train", *NANO, "--steps", "1", "--out", str(run_dir)]) == 0
    code = cli.main(
        ["train", "--resume", "--plan", str(run_dir / "plan.json"), "--steps", "2", "--out", str(run_dir)]
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "started with --micro-batch 2" in line and "resume it without --plan" in line
    assert "both say" not in line
