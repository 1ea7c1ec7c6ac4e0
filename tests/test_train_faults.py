"""``microbatch train`` under faults: signals, leftovers, resumes, OOM, bad numbers, full disks.

Each test here failed before its fix (issue #11's training-run items).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import microbatch.training.loop as loop_module
import microbatch.training.run_folder as run_folder
import microbatch.training.session as session_module
from microbatch import cli
from microbatch.errors import ConfigError, TrainingError
from microbatch.training import TrainConfig, load_checkpoint, train
from microbatch.training.signals import StopFlag
from train_signals import interrupt_train

NANO = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--no-progress")
BASE = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=100)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_train(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------ signals


@pytest.mark.slow
def test_sigterm_saves_writes_the_summary_and_exits_143(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    args = [*NANO, "--steps", "100000", "--checkpoint-interval", "100000", "--out", str(run_dir)]
    returncode, err = interrupt_train(args, run_dir, signal.SIGTERM, after_steps=2)
    assert returncode == 143, err
    assert "Traceback" not in err
    assert f"microbatch train --resume --out {run_dir}" in err
    steps_done = load_checkpoint(str(run_dir / "checkpoint.pt"))["step"]
    assert steps_done >= 2  # nothing lost: the checkpoint interval was never reached
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["stopped_by"] == "SIGTERM"
    assert summary["steps_done"] == steps_done


def test_a_second_signal_stops_at_once() -> None:
    with StopFlag().installed() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() == (True, "SIGTERM")
        with pytest.raises(SystemExit) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ------------------------------------------------------------------------------------------ run folder


def test_leftover_temporary_files_are_removed_on_start_and_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / ".checkpoint.pt.123.abcd1234.tmp").write_bytes(b"x" * 1000)
    train(dataclasses.replace(BASE, steps=1, out=str(run_dir)))
    assert not list(run_dir.glob(".*.tmp"))
    (run_dir / ".checkpoint.pt.456.ffff0000.tmp").write_bytes(b"x" * 1000)
    train(dataclasses.replace(BASE, steps=2, out=str(run_dir), resume=True))
    assert not list(run_dir.glob(".*.tmp"))


def test_summary_describes_the_whole_run_across_resumes(tmp_path: Path) -> None:
    whole = train(dataclasses.replace(BASE, steps=4, out=str(tmp_path / "whole")))
    train(dataclasses.replace(BASE, steps=2, out=str(tmp_path / "halves")))
    resumed = train(dataclasses.replace(BASE, steps=4, out=str(tmp_path / "halves"), resume=True))
    assert resumed.tokens == whole.tokens == sum(m["items"] for m in read_metrics(tmp_path / "whole"))
    assert resumed.first_loss == whole.first_loss
    saved = json.loads((tmp_path / "halves" / "summary.json").read_text())
    assert saved["tokens"] == whole.tokens
    assert saved["steps_done"] == 4


def test_fewer_steps_than_a_finished_run_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "3", "--out", str(run_dir), capsys=capsys)[0] == 0
    code, _, err = run_train("--resume", "--steps", "2", "--out", str(run_dir), capsys=capsys)
    assert code == 2, err
    assert "already done 3 optimizer steps" in last_line(err)
    assert len(read_metrics(run_dir)) == 3


def test_resuming_a_run_killed_after_its_last_checkpoint_writes_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "3", "--out", str(run_dir), capsys=capsys)[0] == 0
    before = (run_dir / "checkpoint.pt").read_bytes()
    (run_dir / "summary.json").unlink()  # kill -9 between the last checkpoint and the summary
    code, _, err = run_train("--resume", "--out", str(run_dir), capsys=capsys)
    assert code == 0, err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps_done"], summary["total_steps"]) == (3, 3)
    assert summary["tokens"] == sum(record["items"] for record in read_metrics(run_dir))
    assert (run_dir / "checkpoint.pt").read_bytes() == before  # nothing trained, nothing rewritten
    assert len(read_metrics(run_dir)) == 3


# ------------------------------------------------------------------------------------------ OOM


def test_training_time_oom_replans_and_continues_from_the_same_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(BASE, micro_batch=4, steps=3)
    reference = train(dataclasses.replace(config, out=str(tmp_path / "reference")))
    real_loss = loop_module.gpt_loss
    calls = {"n": 0}

    def failing_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:  # step 2's second micro-batch: its first one's gradient is already in
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(model, batch)

    monkeypatch.setattr(loop_module, "gpt_loss", failing_loss)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        recovered = train(dataclasses.replace(config, out=str(tmp_path / "recovered")))
    assert "out of memory at step 2" in caplog.text
    assert recovered.steps_done == 3 and recovered.replans == 1
    assert recovered.plan["micro_batch_size"] == 2  # the failed micro-batch 4 is excluded
    # Same windows, same data, a different split: equal to the unbroken run up to float32 rounding.
    a, b = read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "recovered")
    assert [m["items"] for m in a] == [m["items"] for m in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y["loss"], x["loss"], rtol=1e-5, atol=0)
        torch.testing.assert_close(y["grad_norm"], x["grad_norm"], rtol=1e-4, atol=0)
    assert recovered.tokens == reference.tokens
    state = load_checkpoint(str(tmp_path / "recovered" / "checkpoint.pt"))
    assert state["plan"]["micro_batch_size"] == 2


# ------------------------------------------------------------------------------------------ numbers


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_lr_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, _, err = run_train(*NANO, f"--lr={value}", "--out", str(tmp_path / "r"), capsys=capsys)
    assert code == 2, err
    assert "--lr must be a finite number" in last_line(err)
    assert not (tmp_path / "r").exists()


def test_non_finite_hyperparameters_are_refused() -> None:
    changes = ({"weight_decay": float("nan")}, {"max_grad_norm": float("inf")}, {"dropout": float("nan")})
    for change in changes:
        with pytest.raises(ConfigError, match="finite"):
            train(dataclasses.replace(BASE, **change))  # type: ignore[arg-type]


def test_consecutive_skipped_steps_stop_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_loss = loop_module.gpt_loss

    def nan_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        loss, items = real_loss(model, batch)
        return loss * float("nan"), items

    monkeypatch.setattr(loop_module, "gpt_loss", nan_loss)
    with pytest.raises(TrainingError, match=r"last 3 optimizer steps .* were all skipped"):
        train(dataclasses.replace(BASE, steps=50, max_skipped_windows=3, out=str(tmp_path / "r")))
    assert len(read_metrics(tmp_path / "r")) == 3


# ------------------------------------------------------------------------------------------ messages


def test_garbage_checkpoint_never_advises_weights_only_false(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "1", "--out", str(run_dir), capsys=capsys)[0] == 0
    # A pickle that torch's weights-only loader refuses (its message advises weights_only=False).
    torch.save({"format": "microbatch-train-checkpoint", "payload": Path("x")}, run_dir / "checkpoint.pt")
    code, _, err = run_train("--resume", "--steps", "3", "--out", str(run_dir), capsys=capsys)
    assert code == 2, err
    assert "corrupted or not a microbatch checkpoint" in last_line(err)
    assert "weights_only" not in err


def test_device_meta_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_train(*NANO, "--device", "meta", "--out", str(tmp_path / "r"), capsys=capsys)
    assert code == 2, err
    assert "--device meta holds no data" in last_line(err)
    assert "Traceback" not in err


def test_full_disk_on_save_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "1", "--out", str(run_dir), capsys=capsys)[0] == 0
    before = (run_dir / "checkpoint.pt").read_bytes()

    def full_disk(obj: Any, file: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(session_module.torch, "save", full_disk)
    code, _, err = run_train("--resume", "--steps", "2", "--out", str(run_dir), capsys=capsys)
    assert code == 2, err
    assert "the disk is full" in last_line(err)
    assert "last checkpoint (step 1) is intact" in last_line(err)
    assert (run_dir / "checkpoint.pt").read_bytes() == before
    assert not list(run_dir.glob(".*.tmp"))


@contextlib.contextmanager
def file_size_limit(limit_bytes: int) -> Iterator[None]:
    """RLIMIT_FSIZE for this process (a full disk without filling one): writes past it fail with EFBIG."""
    resource = pytest.importorskip("resource")
    if not hasattr(signal, "SIGXFSZ"):
        pytest.skip("no RLIMIT_FSIZE here")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < limit_bytes:
        pytest.skip("the file-size limit is already lower")
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Python ignores it already; be sure
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_torch_save_past_a_file_size_limit_is_an_oserror_and_the_old_file_stays(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint.pt")
    run_folder.atomic_write(path, lambda file: torch.save({"small": torch.zeros(10)}, file))
    before = Path(path).read_bytes()
    with file_size_limit(64 * 1024), pytest.raises(OSError, match="large") as raised:
        # torch.save alone raises "RuntimeError: ... unexpected pos" here, naming no file and no cause
        run_folder.atomic_write(path, lambda file: torch.save({"big": torch.zeros(100_000)}, file))
    assert raised.value.errno == errno.EFBIG
    assert Path(path).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no partial temp file


def test_checkpoint_past_a_file_size_limit_is_a_clear_error_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "1", "--out", str(run_dir), capsys=capsys)[0] == 0
    before = (run_dir / "checkpoint.pt").read_bytes()
    limit = len(before) - 4096  # the text files fit, the next checkpoint does not
    with file_size_limit(limit):
        code, _, err = run_train("--resume", "--steps", "2", "--out", str(run_dir), capsys=capsys)
    assert code == 2, err
    assert "Traceback" not in err
    line = last_line(err)
    assert str(run_dir / "checkpoint.pt") in line and "EFBIG" in line and "ulimit -f" in line, line
    assert "last checkpoint (step 1) is intact" in line and "--resume" in line
    assert (run_dir / "checkpoint.pt").read_bytes() == before
    assert not list(run_dir.glob(".*.tmp"))


def test_out_of_memory_while_evaluating_a_manual_plan_evaluates_in_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(BASE, micro_batch=3, steps=2, eval_interval=1)
    reference = train(dataclasses.replace(config, out=str(tmp_path / "reference")))
    real_loss = loop_module.gpt_loss
    calls = {"n": 0}

    def failing_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        if not model.training:  # an evaluation forward: the first one, after step 1, runs out of memory
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(model, batch)

    monkeypatch.setattr(loop_module, "gpt_loss", failing_loss)
    with caplog.at_level(logging.WARNING, logger="microbatch"):
        recovered = train(dataclasses.replace(config, out=str(tmp_path / "recovered")))
    assert "out of memory while evaluating at step 1" in caplog.text
    assert recovered.steps_done == 2 and recovered.replans == 0
    a, b = read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "recovered")
    # The steps are untouched (bitwise); the validation loss of pieces equals the whole batches' up
    # to float32 rounding of the per-piece means.
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y["val_loss"], x["val_loss"], rtol=1e-6, atol=0)
    assert recovered.tokens == reference.tokens


def test_out_of_memory_evaluating_one_sequence_saves_the_step_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_loss = loop_module.gpt_loss

    def failing_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        if not model.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(model, batch)

    monkeypatch.setattr(loop_module, "gpt_loss", failing_loss)
    run_dir = tmp_path / "r"
    config = dataclasses.replace(BASE, micro_batch=3, steps=3, eval_interval=1, out=str(run_dir))
    with pytest.raises(TrainingError, match=r"single validation sequence after step 1.*--resume"):
        train(config)
    assert load_checkpoint(str(run_dir / "checkpoint.pt"))["step"] == 1
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
