"""One list of model names for every command, each command's own exit statuses, "did you mean",
and a workload module found in the current directory (issue 25, points 8 and 12)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from microbatch.cli import COMMANDS, main
from microbatch.models.gpt import GPT_SIZES
from microbatch.workload import BUILTIN_WORKLOADS

MLP_MODULE = textwrap.dedent(
    """
    import torch
    from torch import nn
    import microbatch as mb

    def mlp():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

        def make_batch(b):
            return torch.randn(b, 32), torch.randn(b, 1)

        def loss(m, batch):
            x, y = batch
            return nn.functional.mse_loss(m(x), y), x.shape[0]

        return mb.Workload(model=model, make_batch=make_batch, loss=loss, name="mlp")
    """
)


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_each_command_help_ends_with_its_own_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    helps = {command: help_of(command, capsys) for command in COMMANDS}
    verify_meaning = "when the accumulated gradient equals the full-batch gradient"
    assert verify_meaning in helps["verify"]
    for command in ("train", "plan", "bench"):
        assert verify_meaning not in helps[command] and "1 verify" not in helps[command], command
    assert "143 by SIGTERM" in helps["train"]
    assert "a budget no plan fits" in helps["plan"]
    assert "1 a suite failed" in helps["bench"]
    assert "(or a workload)" not in helps["train"]


def test_every_gpt_size_train_takes_is_a_workload_of_plan_and_verify(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert set(GPT_SIZES) <= set(BUILTIN_WORKLOADS)
    assert main(["verify", "gpt-nano", "--batch", "4", "--steps", "2"]) == 0
    assert "verify gpt-nano" in capsys.readouterr().out


def test_an_unknown_model_lists_every_form_and_the_closest_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt-minii", "--batch", "4", "--memory", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean gpt-mini" in err
    for form in ("seed-linear", "gpt-nano", "llama-3.1-8b", "config.json", "package.module:function"):
        assert form in err, form
    assert main(["train", "--model", "gpt-minii", "--out", "unused"]) == 2
    assert "Did you mean gpt-mini" in capsys.readouterr().err


def test_train_says_where_a_workload_goes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "mymod:mlp", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "trains the built-in GPT sizes only" in err and "microbatch plan mymod:mlp" in err


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["plan", "gpt-mini", "--batch", "4", "--memroy", "8GiB"], "--memory"),
        (["train", "--stpes", "3"], "--steps"),
        (["verify", "seed-linear", "--batchh=4"], "--batch"),
    ],
)
def test_a_mistyped_option_gets_did_you_mean(
    argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert f"(did you mean {suggestion}?)" in capsys.readouterr().err


def test_a_workload_module_in_the_current_directory_is_found_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mymod_here.py").write_text(MLP_MODULE)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymod_here", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["verify", "mymod_here:mlp", "--batch", "8", "--steps", "2"]) == 2
    assert (
        f"neither sys.path nor the current directory {elsewhere} holds mymod_here.py"
        in capsys.readouterr().err
    )
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "mymod_here:mlp", "--batch", "8", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert f"importing mymod_here from the current directory {tmp_path} (as python -m does)" in captured.err
    assert "verify mlp" in captured.out
    monkeypatch.delitem(sys.modules, "mymod_here", raising=False)
