"""Faults a user can cause in planning and on the command line: clear answers, nothing lost (issue #11)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import microbatch as mb
from microbatch.cli import main
from microbatch.errors import InfeasibleBudgetError, WorkloadError
from microbatch.memory.optimizer_state import fresh_optimizer_like, optimizer_state_bytes
from microbatch.planner import planning as trial_module
from microbatch.planner.proof import trial_run
from microbatch.planner.search import splits as search_module
from microbatch.workload import seed_linear


# ----------------------------------------------------------------------------- a bounded search
def test_window_sizes_behave_like_the_list_they_stand_for() -> None:
    for total, size in ((10, 3), (12, 4), (7, 7), (5, 9), (1, 1)):
        window = search_module.WindowSizes(total, size)
        expected = [min(size, total)] * (total // min(size, total))
        if total % min(size, total):
            expected.append(total % min(size, total))
        assert list(window) == expected and len(window) == len(expected)
        assert window == tuple(expected) and window[0] == expected[0] and window[-1] == expected[-1]
        assert window[:2] == tuple(expected[:2])
        assert sum(n for _, n in window.counts) == len(expected)


@pytest.mark.parametrize("batch", [4097, 10**6, 10**12])
def test_candidate_sizes_are_few_and_within_the_window_limit(batch: int) -> None:
    sizes = search_module.candidate_sizes(batch)
    assert sizes == sorted(set(sizes), reverse=True) and sizes[0] == batch
    assert len(sizes) <= 8 * math.log2(batch) + search_module.SMALL_SIZES
    for b in sizes:
        steps = -(-batch // b)
        assert steps <= search_module.MAX_STEPS_PER_WINDOW
        assert b == -(-batch // steps)  # the smallest b for its step count


def test_a_batch_beyond_the_window_limit_is_refused_clearly() -> None:
    with pytest.raises(InfeasibleBudgetError, match="micro-batches per optimizer step") as caught:
        mb.plan(seed_linear(), batch=10**12, memory="10MiB")
    assert "lower the batch" in str(caught.value)


# ----------------------------------------------------------------------------- out of memory in the trial
def oom_above(limit: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Trials of micro-batches larger than ``limit`` run out of memory; returns the sizes tried."""
    real = trial_run.run_trial
    tried: list[int] = []

    def trial(workload: Any, candidate: Any, **options: Any) -> Any:
        tried.append(candidate.micro_batch_size)
        if candidate.micro_batch_size > limit:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(workload, candidate, **options)

    monkeypatch.setattr(trial_run, "run_trial", trial)
    return tried


def test_after_out_of_memory_trials_smaller_micro_batches_are_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = oom_above(1, monkeypatch)
    result = mb.plan(seed_linear(), batch=32, memory="64MiB")
    assert result.micro_batch_size == 1 and result.steps == 32
    assert tried[0] > 1 and tried[-1] == 1


def test_when_every_trial_runs_out_of_memory_the_error_says_at_least(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = oom_above(0, monkeypatch)
    with pytest.raises(InfeasibleBudgetError, match="at least") as caught:
        mb.plan(seed_linear(), batch=32, memory="64MiB")
    assert caught.value.minimum_is_lower_bound
    assert 1 in tried  # the smallest plan was tried before giving up


# ------------------------------------------------------------------- optimizer state before profiling
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    ],
)
def test_optimizer_state_bytes_match_a_real_step(make: Any) -> None:
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    optimizer = make(model.parameters())
    before = len(optimizer.state)
    counted, exact = optimizer_state_bytes(model, optimizer)
    assert exact and len(optimizer.state) == before  # counting leaves the optimizer as it was
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    real = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0  # per-parameter tensors, not step counts
    )
    assert counted == real


def test_budget_below_parameters_gradients_and_optimizer_state_fails_before_profiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workload = seed_linear()
    workload.optimizer = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)
    weights = sum(p.numel() * p.element_size() for p in workload.model.parameters())

    def no_profiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("profiled although the static memory alone exceeds the budget")

    monkeypatch.setattr(trial_module, "profile_workload", no_profiling)
    with pytest.raises(InfeasibleBudgetError, match="Adam state") as caught:
        mb.plan(workload, batch=8, memory=4 * weights - 1)
    assert caught.value.minimum_bytes == 4 * weights and caught.value.minimum_is_lower_bound


# ----------------------------------------------------------------------------- workload checks
def test_plan_refuses_make_batch_with_the_wrong_sample_count(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = seed_linear()
    make = workload.make_batch
    workload.make_batch = lambda b: make(b + 1)
    monkeypatch.setattr(trial_module, "profile_workload", lambda *a, **k: pytest.fail("profiled"))
    with pytest.raises(WorkloadError, match=r"make_batch\(\d\) .* returned a batch of \d samples"):
        mb.plan(workload, batch=8, memory="64MiB")


def test_workload_optimizer_may_be_an_instance_that_is_never_stepped() -> None:
    workload = seed_linear()
    optimizer = torch.optim.SGD(
        [{"params": [workload.model.weight], "lr": 0.05}, {"params": [workload.model.bias]}],
        lr=0.1,
        momentum=0.9,
    )
    steps: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    weight = workload.model.weight.detach().clone()
    workload.optimizer = optimizer
    result = mb.plan(workload, batch=8, memory="64MiB")
    assert result.measured_peak_bytes is not None
    assert steps == [] and len(optimizer.state) == 0
    assert torch.equal(workload.model.weight.detach(), weight)
    fresh = fresh_optimizer_like(optimizer)
    assert type(fresh) is torch.optim.SGD and fresh is not optimizer
    assert [g["lr"] for g in fresh.param_groups] == [0.05, 0.1]
    assert (
        fresh.param_groups[0]["momentum"] == 0.9
        and fresh.param_groups[0]["params"][0] is workload.model.weight
    )


# ----------------------------------------------------------------------------- the command line
USER_MODULE = """
import torch
from microbatch.workload import Workload, seed_linear


def broken_batches():
    base = seed_linear()

    def make_batch(b):
        raise ValueError("my data file is missing")

    return Workload(model=base.model, make_batch=make_batch, loss=base.loss, name="broken")


def broken_loss():
    base = seed_linear()

    def loss(model, batch):
        return helper(batch)

    return Workload(model=base.model, make_batch=base.make_batch, loss=loss, name="broken-loss")


def helper(batch):
    raise KeyError("labels")
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "faulty_workloads.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "faulty_workloads"


@pytest.mark.parametrize(
    ("command", "factory", "function"),
    [
        (["plan", "--batch", "8", "--memory", "64MiB"], "broken_batches", ("<locals>.make_batch",)),
        (["verify", "--batch", "8", "--steps", "2"], "broken_batches", ("<locals>.make_batch",)),
        (["verify", "--batch", "8", "--steps", "2"], "broken_loss", ("<locals>.loss", "in helper")),
    ],
)
def test_user_code_errors_are_one_line_with_exit_status_2(
    user_module: str,
    command: list[str],
    factory: str,
    function: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [command[0], f"{user_module}:{factory}", *command[1:]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "error in your code" in lines[0]
    assert all(name in lines[0] for name in function)
    assert "Traceback" not in err and "--verbose" in lines[0]
    assert main(["--verbose", *argv]) == 2
    verbose = capsys.readouterr().err
    assert "Traceback" in verbose and function[0] in verbose


def test_exit_statuses_are_documented_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("verify", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Exit status" in text and "your own code" in text
        assert ("differ" in text) == (command == "verify")  # each command's own statuses (issue 25)


def test_plan_checks_the_plot_path_before_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("microbatch.commands.plan.plan", lambda *a, **k: pytest.fail("planned"))
    missing = tmp_path / "no-such-dir" / "frontier.png"
    assert main(["plan", "seed-linear", "--batch", "8", "--memory", "64MiB", "--plot", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plan", "seed-linear", "--batch", "8", "--memory", "64MiB", "--plot", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
