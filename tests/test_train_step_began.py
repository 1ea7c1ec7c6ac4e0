"""``microbatch train`` never runs a window again once its optimizer step began (issue 22).

An out-of-memory error in the micro-batch loop is retried after re-planning (test_train_faults);
one raised inside the optimizer's own step (AdamW allocating its state, the classic place) left
the parameters and optimizer state half updated, and was "recovered" by running the window again:
one window applied twice. Now the run stops with a TrainingError and the last good checkpoint
stays as it was. Also: every random state a window draws from is put back for the re-run, and
summary.json counts the re-plans of the whole run across resumes.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import microbatch as mb
import microbatch.training.loop as loop_module
from microbatch.errors import TrainingError
from microbatch.training import TrainConfig, load_checkpoint, train

BASE = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, eval_interval=100)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REAL_ADAMW = torch.optim.AdamW


class StepsThenFails(REAL_ADAMW):
    """AdamW whose second step updates everything and then runs out of memory (a later allocation)."""

    taken = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        type(self).taken += 1
        if type(self).taken == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return result


def test_oom_inside_the_optimizer_step_stops_without_a_rerun_or_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setattr(torch.optim, "AdamW", StepsThenFails)
    StepsThenFails.taken = 0
    config = dataclasses.replace(BASE, steps=3, checkpoint_interval=1, out=str(run_dir))
    with pytest.raises(TrainingError, match="inside the optimizer's step at step 2") as raised:
        train(config)
    assert "not run again" in str(raised.value) and "--resume" in str(raised.value)
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    assert StepsThenFails.taken == 2  # step 1, then step 2 once: no re-run of the window
    state = load_checkpoint(str(run_dir / "checkpoint.pt"))
    assert state["step"] == 1  # the last good checkpoint, not the half-stepped state
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def _fake_session(device: torch.device) -> Any:
    model = torch.nn.Linear(3, 1).to(device)
    acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = types.SimpleNamespace(state_dict=lambda: {"position": 0})
    return types.SimpleNamespace(device=device, train_data=data, accumulator=acc)


def _draws(device: torch.device) -> list[torch.Tensor]:
    # Dropout on CPU draws from the CPU generator, on CUDA from the device's.
    return [torch.rand(4), torch.rand(4, device=device)]


@pytest.mark.parametrize(
    "device_type",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu])],
)
def test_the_window_rerun_puts_back_every_random_state_it_draws_from(device_type: str) -> None:
    if device_type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA: the device generator is only there")
    device = torch.device(device_type)
    session = _fake_session(device)
    start = loop_module._window_start(session)
    first = _draws(device)
    loop_module._restore_rng(session, start)
    again = _draws(device)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert (start["cuda_rng"] is not None) == (device_type == "cuda")


@pytest.mark.slow
def test_summary_counts_the_replans_of_the_whole_resumed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    config = dataclasses.replace(BASE, micro_batch=4, steps=2, out=str(run_dir))
    real_loss = loop_module.gpt_loss
    calls = {"n": 0}

    def failing_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # step 2's first micro-batch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(model, batch)

    with monkeypatch.context() as patch:
        patch.setattr(loop_module, "gpt_loss", failing_loss)
        first = train(config)
    assert first.replans == 1
    resumed = train(dataclasses.replace(config, steps=3, resume=True))
    assert resumed.steps_done == 3 and resumed.replans == 1
    assert load_checkpoint(str(run_dir / "checkpoint.pt"))["replans"] == 1


def test_the_oom_rerun_starts_from_the_failed_windows_random_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed window's first micro-batch drew dropout masks (and re-planning runs trial windows):
    the re-run must start from the random state the failed window started from."""
    config = dataclasses.replace(BASE, micro_batch=4, steps=3, dropout=0.1, out=str(tmp_path / "run"))
    real_loss, real_run_window = loop_module.gpt_loss, loop_module._run_window
    calls = {"n": 0}
    states: list[torch.Tensor] = []

    def failing_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        calls["n"] += 1
        if calls["n"] == 4:  # step 2's second micro-batch: the first one drew its dropout masks
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_loss(model, batch)

    def recording_run_window(session: Any, micro_batches: Any) -> Any:
        states.append(torch.get_rng_state())
        return real_run_window(session, micro_batches)

    monkeypatch.setattr(loop_module, "gpt_loss", failing_loss)
    monkeypatch.setattr(loop_module, "_run_window", recording_run_window)
    summary = train(config)
    assert summary.replans == 1 and len(states) == 4  # step 1, step 2 (failed), step 2 again, step 3
    assert torch.equal(states[1], states[2])
    checkpoint = load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))
    assert checkpoint["replans"] == 1
