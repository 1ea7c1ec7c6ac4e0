"""``microbatch train``: run folder, exact resume, SIGINT, learning, plans, and clear errors."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from microbatch import cli
from microbatch.commands.train import ProgressLine
from microbatch.training import (
    StepReport,
    TrainConfig,
    load_checkpoint,
    lr_factor,
    scaled_hyperparameters,
    train,
)
from train_signals import interrupt_train

RUN_FILES = ("metrics.jsonl", "plan.json", "loss.png", "summary.json", "checkpoint.pt", "config.json")
# Fields of a metrics line that depend only on the computation (not on time or measurement).
EXACT_FIELDS = ("step", "loss", "items", "lr", "grad_norm", "skipped", "micro_batches")
# gpt-nano (2 layers, n_embd 32, block 32): a few steps take well under a second. A manual plan
# (--micro-batch 2: Plan.manual, no profiling) keeps these tests quick and independent of the
# planner, and accumulates over 4 micro-batches of an effective batch of 8.
NANO = ("--model", "gpt-nano", "--batch", "8", "--micro-batch", "2", "--no-progress")
SMALL_MEMORY = "2MiB"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_train(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = load_checkpoint(str(run_dir / "checkpoint.pt"))["model"]
    return state


# ------------------------------------------------------------------------------------------ end to end


def test_end_to_end_writes_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    args = ("--steps", "4", "--memory", SMALL_MEMORY, "--eval-interval", "2", "--out", str(run_dir), "--json")
    code, out, err = run_train(*NANO, *args, capsys=capsys)
    assert code == 0, err
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    summary = json.loads(out)
    assert summary["steps_done"] == 4
    assert summary["interrupted"] is False
    assert json.loads((run_dir / "summary.json").read_text())["final_loss"] == summary["final_loss"]

    metrics = read_metrics(run_dir)
    assert [record["step"] for record in metrics] == [1, 2, 3, 4]
    for record in metrics:
        for key in ("loss", "items", "lr", "grad_norm", "peak_bytes", "micro_batches", "tokens_per_second"):
            assert key in record, key
        assert record["items"] > 0
        assert record["peak_bytes"] > 0
        assert torch.isfinite(torch.tensor(record["loss"]))
    assert [("val_loss" in record) for record in metrics] == [False, True, False, True]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["steps"] > 1  # the small budget makes the plan accumulate
    assert plan["micro_batch_size"] * plan["steps"] >= 8
    assert all(record["micro_batches"] == plan["steps"] for record in metrics)
    assert (run_dir / "loss.png").read_bytes()[:8] == PNG_SIGNATURE
    # The checkpoint holds everything resume needs, at the last window boundary.
    state = load_checkpoint(str(run_dir / "checkpoint.pt"))
    assert state["step"] == 4
    for key in ("model", "optimizer", "scheduler", "accumulator", "ranks", "plan", "config"):
        assert key in state, key


def test_human_summary_and_progress_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["train", "--model", "gpt-nano", "--batch", "4", "--steps", "3", "--out", str(tmp_path / "r")]
    )
    captured = capsys.readouterr()
    assert code == 0
    assert "finished 3/3 steps of gpt-nano" in captured.out
    assert "step 3/3" in captured.err  # the progress display, on stderr


def test_progress_line_redraws_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = ProgressLine(stream)
    for step in (1, 2):
        report = StepReport(
            step=step, total_steps=2, loss=3.5, lr=1e-3, tokens_per_second=1234.0,
            peak_bytes=3 * 2**20, eta_seconds=65.0, val_loss=3.0 if step == 2 else None,
        )  # fmt: skip
        progress(report)
    text = stream.getvalue()
    assert text.count("\r") == 2
    assert text.endswith("\n")
    assert "loss 3.500" in text
    assert "1,234 tok/s" in text
    assert "lr 1.00e-03" in text
    assert "peak 3.00 MiB" in text
    assert "ETA 1:05" in text
    assert "val 3.000" in text


# ------------------------------------------------------------------------------------------ exactness


def test_resume_gives_the_same_metrics_and_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = (*NANO, "--memory", SMALL_MEMORY, "--eval-interval", "2")
    whole, first_half = tmp_path / "whole", tmp_path / "halves"
    assert run_train(*common, "--steps", "6", "--out", str(whole), capsys=capsys)[0] == 0
    assert run_train(*common, "--steps", "3", "--out", str(first_half), capsys=capsys)[0] == 0
    code, _, err = run_train(
        "--resume", "--steps", "6", "--out", str(first_half), "--no-progress", capsys=capsys
    )
    assert code == 0, err
    whole_metrics, resumed_metrics = read_metrics(whole), read_metrics(first_half)
    assert len(resumed_metrics) == 6
    assert all(record["peak_bytes"] > 0 for record in resumed_metrics)  # measured from the resumed step on
    for a, b in zip(whole_metrics, resumed_metrics, strict=True):
        assert {k: a[k] for k in EXACT_FIELDS} == {k: b[k] for k in EXACT_FIELDS}
    whole_state, resumed_state = model_state(whole), model_state(first_half)
    for name, tensor in whole_state.items():
        assert torch.equal(tensor, resumed_state[name]), name
    summary = json.loads((first_half / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3


def test_resume_is_exact_with_dropout_and_accumulation_warmup(tmp_path: Path) -> None:
    # Dropout draws from the global RNG and --nominal-batch makes windows grow: both must resume.
    base = TrainConfig(
        model="gpt-nano", batch=8, memory=SMALL_MEMORY, dropout=0.1, nominal_batch=16, warmup_steps=3,
        eval_interval=2, micro_batch=2,
    )  # fmt: skip
    whole = train(dataclasses.replace(base, steps=6, out=str(tmp_path / "whole")))
    train(dataclasses.replace(base, steps=2, out=str(tmp_path / "halves")))
    resumed = train(dataclasses.replace(base, steps=6, out=str(tmp_path / "halves"), resume=True))
    assert resumed.resumed_from_step == 2
    assert whole.final_loss == resumed.final_loss
    whole_metrics, resumed_metrics = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "halves")
    windows = [m["micro_batches"] for m in whole_metrics]
    assert windows[0] < windows[-1]
    for a, b in zip(whole_metrics, resumed_metrics, strict=True):
        assert {k: a[k] for k in EXACT_FIELDS} == {k: b[k] for k in EXACT_FIELDS}
    for name, tensor in model_state(tmp_path / "whole").items():
        assert torch.equal(tensor, model_state(tmp_path / "halves")[name]), name


def test_accumulated_step_equals_the_full_batch_step(tmp_path: Path) -> None:
    # Same data, two plans: one micro-batch of 8, or several smaller ones. The accumulated window
    # must give the full batch's token-mean loss and gradient (float32: rtol 1e-5 on the loss and
    # gradient norm; 1e-4 on the second step's loss, after one AdamW update from each gradient).
    # The accumulated plan is 3 + 3 + 2: a short last micro-batch, exact all the same.
    base = TrainConfig(model="gpt-nano", batch=8, steps=2, eval_interval=100)
    full = train(dataclasses.replace(base, micro_batch=8, out=str(tmp_path / "full")))
    accumulated = train(dataclasses.replace(base, micro_batch=3, out=str(tmp_path / "accumulated")))
    assert full.plan["steps"] == 1
    assert accumulated.plan["steps"] > 1
    full_metrics, accumulated_metrics = (
        read_metrics(tmp_path / "full"),
        read_metrics(tmp_path / "accumulated"),
    )
    assert [m["items"] for m in full_metrics] == [m["items"] for m in accumulated_metrics]
    first_full, first_accumulated = full_metrics[0], accumulated_metrics[0]
    torch.testing.assert_close(first_accumulated["loss"], first_full["loss"], rtol=1e-5, atol=0)
    torch.testing.assert_close(first_accumulated["grad_norm"], first_full["grad_norm"], rtol=1e-5, atol=0)
    torch.testing.assert_close(accumulated_metrics[1]["loss"], full_metrics[1]["loss"], rtol=1e-4, atol=0)


def test_checkpoint_policy_full_matches_no_checkpointing(tmp_path: Path) -> None:
    base = TrainConfig(model="gpt-nano", batch=4, steps=2, micro_batch=4, eval_interval=100)
    plain = train(dataclasses.replace(base, checkpoint_policy="none", out=str(tmp_path / "none")))
    checkpointed = train(dataclasses.replace(base, checkpoint_policy="full", out=str(tmp_path / "full")))
    assert set(checkpointed.plan["policies"].values()) == {"full"}
    assert plain.plan["policies"] == {}
    for a, b in zip(read_metrics(tmp_path / "none"), read_metrics(tmp_path / "full"), strict=True):
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-6, atol=0)
        torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-5, atol=0)
    assert plain.final_loss is not None


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path: Path, precision: str) -> None:
    summary = train(
        TrainConfig(model="gpt-nano", batch=4, steps=3, precision=precision, out=str(tmp_path / "r"))
    )
    assert summary.final_loss is not None
    assert torch.isfinite(torch.tensor(summary.final_loss))
    state = load_checkpoint(str(tmp_path / "r" / "checkpoint.pt"))
    assert (state["scaler"] is not None) == (precision == "fp16")


# ------------------------------------------------------------------------------------------ learning


@pytest.mark.slow
def test_default_run_learns(tmp_path: Path) -> None:
    # The default model, batch, budget and planner; the first 30 of the default run's 200 optimizer
    # steps. A byte-level model starts near ln(256) = 5.55 nats; Python source is learnable quickly
    # (measured: 5.33 -> about 2.8 after 30 steps), so the margins below are wide but real.
    summary = train(TrainConfig(steps=30, eval_interval=30, out=str(tmp_path / "run")))
    losses = [record["loss"] for record in read_metrics(tmp_path / "run")]
    assert losses[0] > 5.0
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert summary.val_loss is not None
    assert summary.val_loss < losses[0] - 1.0


# ------------------------------------------------------------------------------------------ schedules, plan


def test_lr_schedule_does_not_depend_on_the_run_length() -> None:
    assert lr_factor(0, warmup_steps=4, decay_steps=None) == 0.25
    assert lr_factor(3, warmup_steps=4, decay_steps=None) == 1.0
    assert lr_factor(500, warmup_steps=4, decay_steps=None) == 1.0
    assert lr_factor(4, warmup_steps=4, decay_steps=104) == pytest.approx(1.0)
    assert lr_factor(54, warmup_steps=4, decay_steps=104) == pytest.approx(0.55)
    assert lr_factor(1000, warmup_steps=4, decay_steps=104) == pytest.approx(0.1)


def test_nominal_batch_scales_lr_and_weight_decay() -> None:
    config = TrainConfig(batch=128, lr=1e-3, weight_decay=0.1, nominal_batch=64)
    assert scaled_hyperparameters(config) == pytest.approx((1e-3, 0.2))
    linear = dataclasses.replace(config, lr_scaling="linear")
    assert scaled_hyperparameters(linear) == pytest.approx((2e-3, 0.2))
    square_root = dataclasses.replace(config, lr_scaling="sqrt")
    assert scaled_hyperparameters(square_root)[0] == pytest.approx(1e-3 * 2**0.5)


# ------------------------------------------------------------------------------------------ bad input


def assert_clear_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    last_line = err.strip().splitlines()[-1]  # after any INFO lines: one line saying what is wrong
    assert last_line.startswith("microbatch train: error:")
    for fragment in fragments:
        assert fragment in last_line, (fragment, err)


def test_memory_below_the_minimum(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--model", "gpt-nano", "--batch", "8", "--memory", "10KiB")
    code, _, err = run_train(*args, "--out", str(tmp_path / "r"), capsys=capsys)
    assert_clear_error(code, err, "--memory 10.00 KiB is below the minimum of")
    assert not (tmp_path / "r").exists()  # a run that cannot start leaves no folder behind


@pytest.mark.parametrize("batch", ["0", "-3"])
def test_batch_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str], batch: str) -> None:
    code, _, err = run_train("--batch", batch, "--out", str(tmp_path / "r"), capsys=capsys)
    assert_clear_error(code, err, "--batch")
    assert not (tmp_path / "r").exists()


def test_unknown_model_lists_the_builtins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_train("--model", "gpt-huge", "--out", str(tmp_path / "r"), capsys=capsys)
    assert_clear_error(code, err, "gpt-huge", "gpt-mini", "gpt-small")


def test_output_folder_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, _, err = run_train(*NANO, "--steps", "1", "--out", str(blocker / "run"), capsys=capsys)
    assert_clear_error(code, err, "--out", "cannot write")


def test_existing_run_needs_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "1", "--out", str(run_dir), capsys=capsys)[0] == 0
    code, _, err = run_train(*NANO, "--steps", "2", "--out", str(run_dir), capsys=capsys)
    assert_clear_error(code, err, "--resume")


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(run_dir.iterdir())}


def test_corrupted_checkpoint_is_refused_and_nothing_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "2", "--out", str(run_dir), capsys=capsys)[0] == 0
    checkpoint = run_dir / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    before = _snapshot(run_dir)
    code, _, err = run_train("--resume", "--steps", "4", "--out", str(run_dir), capsys=capsys)
    assert_clear_error(code, err, "corrupted", "nothing was changed")
    assert _snapshot(run_dir) == before


def test_mismatched_checkpoint_is_refused_and_nothing_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    assert run_train(*NANO, "--steps", "2", "--out", str(run_dir), capsys=capsys)[0] == 0
    before = _snapshot(run_dir)
    code, _, err = run_train("--resume", "--model", "gpt-mini", "--out", str(run_dir), capsys=capsys)
    assert_clear_error(code, err, "different run", "model", "nothing was changed")
    assert _snapshot(run_dir) == before
    # A checkpoint whose weights do not fit the model it claims (a different run's file copied in).
    state = load_checkpoint(str(run_dir / "checkpoint.pt"))
    state["model"] = {name: tensor[..., :1] for name, tensor in state["model"].items()}
    del state["checksum"]  # unsealed, as an older microbatch saved it: its checksum does not refuse it first
    torch.save(state, run_dir / "checkpoint.pt")
    before = _snapshot(run_dir)
    code, _, err = run_train("--resume", "--steps", "4", "--out", str(run_dir), capsys=capsys)
    assert_clear_error(code, err, "does not match", "nothing was changed")
    assert _snapshot(run_dir) == before


def test_resume_without_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_train("--resume", "--out", str(tmp_path / "empty"), capsys=capsys)
    assert_clear_error(code, err, "no checkpoint")


# ------------------------------------------------------------------------------------------ SIGINT


@pytest.mark.slow
def test_sigint_saves_a_resumable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "r"
    args = [*NANO, "--memory", SMALL_MEMORY, "--steps", "100000", "--out", str(run_dir)]
    returncode, err = interrupt_train(args, run_dir, signal.SIGINT, after_steps=3)
    assert returncode == 130, err
    assert "Traceback" not in err
    assert f"microbatch train --resume --out {run_dir}" in err
    state = load_checkpoint(str(run_dir / "checkpoint.pt"))
    steps_done = state["step"]
    assert steps_done >= 3
    assert len(read_metrics(run_dir)) == steps_done
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] is True
    code, _, err = run_train("--resume", "--steps", str(steps_done + 2), "--out", str(run_dir), capsys=capsys)
    assert code == 0, err
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, steps_done + 3))


# ------------------------------------------------------------------------------------------ torchrun


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _distributed_worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        base = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=2)
        whole = train(dataclasses.replace(base, steps=4, out=os.path.join(root, "whole")))
        train(dataclasses.replace(base, steps=2, out=os.path.join(root, "halves")))
        resumed = train(dataclasses.replace(base, steps=4, out=os.path.join(root, "halves"), resume=True))
        with open(os.path.join(root, f"rank{rank}.json"), "w") as file:
            json.dump({"whole": whole.to_dict(), "resumed": resumed.to_dict()}, file)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_train_resume_and_only_rank_zero_writes(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_distributed_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    summaries = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # Every rank sees the same global loss and item count (the Accumulator all-reduces them).
    assert summaries[0]["whole"]["final_loss"] == summaries[1]["whole"]["final_loss"]
    assert summaries[0]["whole"]["tokens"] == summaries[1]["whole"]["tokens"]
    whole_metrics, resumed_metrics = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "halves")
    assert len(whole_metrics) == 4
    for a, b in zip(whole_metrics, resumed_metrics, strict=True):
        assert {k: a[k] for k in EXACT_FIELDS} == {k: b[k] for k in EXACT_FIELDS}
    for name, tensor in model_state(tmp_path / "whole").items():
        assert torch.equal(tensor, model_state(tmp_path / "halves")[name]), name
    state = load_checkpoint(str(tmp_path / "whole" / "checkpoint.pt"))
    assert state["plan"]["world_size"] == 2
    assert len(state["ranks"]) == 2
    assert not torch.equal(state["ranks"][0]["data"]["generator"], state["ranks"][1]["data"]["generator"])
    # Rank 0 alone wrote the run folder: exactly the run files (and rank 0's marker and lock file),
    # no leftovers from a second writer.
    names = sorted(path.name for path in (tmp_path / "whole").iterdir())
    assert names == sorted([*RUN_FILES, ".microbatch-run.json", ".microbatch.lock"])
