"""The README's Python blocks run as written (none needs the network).

Each block is executed in a namespace that holds what its text assumes already exists (a model, an
optimizer, a loader...); what the block leaves behind is then checked. A README block this file
does not know fails the test: give it a namespace here when you add it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import microbatch as mb
from dual_encoder import DualEncoder, InfoNCE
from dual_encoder import make_batch as make_pair_batch
from microbatch.models.gpt import GPT, gpt_config

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _gpt_and_optimizer() -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(gpt_config("gpt-nano"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": optimizer}


def _token_batch(rows: int, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (rows, length), generator=generator)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return {"input_ids": ids, "labels": labels}


def _loop() -> dict[str, Any]:
    names = _gpt_and_optimizer()
    generator = torch.Generator().manual_seed(1)
    names["loader"] = [_token_batch(2, 16, generator) for _ in range(10)]  # windows of 8, then 2
    names["scheduler"] = torch.optim.lr_scheduler.LambdaLR(names["optimizer"], lambda step: 0.5**step)
    names["F"] = F
    return names


def _check_loop(names: dict[str, Any]) -> None:
    assert names["acc"].window == 2  # a full window and the final partial one, each stepped once
    assert math.isfinite(names["stats"].loss)


def _plan_split() -> dict[str, Any]:
    names = _loop()
    names["plan"] = mb.Plan.manual(batch_size=5, micro_batch_size=2)  # an uneven split: 2 + 2 + 1
    generator = torch.Generator().manual_seed(3)
    names["loader"] = [_token_batch(5, 16, generator) for _ in range(2)]  # one rank's batch each
    return names


def _check_plan_split(names: dict[str, Any]) -> None:
    assert names["plan"].micro_batch_sizes == (2, 2, 1)
    assert names["acc"].window == 2 and names["stats"].micro_batches == 3  # one window per batch
    assert names["stats"].items == 5 * 15  # the batch's predicted tokens (the last label is -100)


def _token_windows() -> dict[str, Any]:
    names = _gpt_and_optimizer()
    generator = torch.Generator().manual_seed(2)
    lengths = [[5, 30, 12, 7], [16, 16, 3]]
    names["batches"] = [
        [torch.randint(0, 256, (n,), generator=generator) for n in window] for window in lengths
    ]

    def pad(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)
        labels = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=-100)
        return {"input_ids": ids, "labels": labels}

    names["pad"] = pad
    names["F"] = F
    return names


def _check_token_windows(names: dict[str, Any]) -> None:
    assert names["acc"].window == 2  # one optimizer step per window of samples
    assert names["stats"].items == 16 + 16 + 3  # the second window's real tokens, padding not counted


def _cached() -> dict[str, Any]:
    torch.manual_seed(0)
    model = DualEncoder().double()
    info_nce = InfoNCE().double()

    def encode(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return model.encode(batch)

    return {
        "model": model,
        "info_nce": info_nce,
        "batch": make_pair_batch(32, seed=0),
        "encode": encode,
        "make_batch": lambda size: make_pair_batch(size, seed=1),
    }


def _check_cached(names: dict[str, Any]) -> None:
    assert torch.isfinite(torch.as_tensor(names["loss"]))
    assert all(p.grad is not None for p in names["model"].parameters())
    assert names["plan"] is not None


def _planning() -> dict[str, Any]:
    # Four identical blocks (blocks="auto" finds them), small enough to plan 256 samples in seconds.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        *(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)),
    )

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(size)
        return torch.randn(size, 8, generator=generator), torch.randn(size, 32, generator=generator)

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        return F.mse_loss(model(x), y), x.shape[0]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    workload = mb.Workload(model=model, make_batch=make_batch, loss=loss, optimizer=optimizer)
    return {"workload": workload, "model": model, "optimizer": optimizer}


def _check_planning(names: dict[str, Any]) -> None:
    plan = names["plan"]
    assert sum(plan.micro_batch_sizes) == 256
    assert plan == mb.Plan.load("plan.json")
    assert names["mem"].peak_bytes > 0


# A marker in the block's text -> (its namespace, the checks on what it leaves behind).
NAMESPACES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "for micro in acc.iterate(loader)": (_loop, _check_loop),
    "plan.split(batch)": (_plan_split, _check_plan_split),
    "mb.TokenWindows(": (_token_windows, _check_token_windows),
    "mb.cached_backward(": (_cached, _check_cached),
    "mb.plan(workload": (_planning, _check_planning),
}


def _loop_body() -> str:
    lines = BLOCKS[0].splitlines()
    start = next(i for i, line in enumerate(lines) if "for micro in acc.iterate(loader)" in line)
    return "\n".join(lines[start + 1 :])


def _setup_for(block: str) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    found = [value for marker, value in NAMESPACES.items() if marker in block]
    assert len(found) == 1, f"README block without exactly one namespace in tests/test_readme.py:\n{block}"
    return found[0]


def test_every_block_is_known() -> None:
    assert len(BLOCKS) >= 4
    for block in BLOCKS:
        _setup_for(block)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block = BLOCKS[index]
    make_names, check = _setup_for(block)
    monkeypatch.chdir(tmp_path)  # plan.save("plan.json") writes here
    names = {"mb": mb, **make_names()}  # the README's first block imports microbatch as mb
    if "# same loop as above" in block:  # as the reader does: the first block's loop body goes there
        block = re.sub(r":\s*\.\.\.\s*# same loop as above", ":\n" + _loop_body(), block)
    exec(compile(block, f"README.md python block {index}", "exec"), names)
    check(names)
    capsys.readouterr()
