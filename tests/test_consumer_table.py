"""benchmarks/consumer.py, issue 34's consumer-GPU table: the cells kept, how a plan or a refusal is
described, and the cited figures beside it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import microbatch as mb
from microbatch.memory import parse_bytes
from microbatch.models import GPT, GPTConfig
from microbatch.models.workloads import gpt_loss
from microbatch.workload import Workload

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ISSUE_CELL = "llama-3.2-1b/full/2048/rtx4090"


def _script(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def _rows() -> dict[str, object]:
    return json.loads((BENCHMARKS / "consumer_rows.json").read_text(encoding="utf-8"))


def test_the_issues_case_plans_after_and_was_refused_before() -> None:
    # issue 34: `microbatch plan llama-3.2-1b --device rtx4090 --batch 128 --seq-len 2048 --precision
    # mixed --memory 23GiB` was refused for the foreach step's temporaries; with the levers it plans.
    row = _rows()[ISSUE_CELL]
    assert isinstance(row, dict)
    before, after = row["before"], row["after"]
    assert before["refused"] and not after["refused"]
    assert after["predicted_peak_bytes"] <= parse_bytes("23GiB")
    assert after["micro_batch_size"] * after["steps"] >= 128
    assert after["optimizer_step"] == "fused" or after["head_chunk_tokens"]


def test_every_kept_plan_is_within_its_budget_and_in_the_table() -> None:
    consumer = _script("consumer")
    rows = _rows()
    markdown = consumer.table(rows)
    cells = {cell.key: cell for cell in consumer.cells()}
    assert len(cells) == 24  # 3 models x full/LoRA x 2 lengths x 2 cards
    for key, row in rows.items():
        if key.startswith("_"):
            continue
        for side in consumer.SIDES:
            if side not in row:
                continue
            outcome = row[side]
            assert consumer.describe(outcome) in markdown or row[side] == row["after"]
            if not outcome["refused"]:
                assert outcome["predicted_peak_bytes"] <= parse_bytes(consumer.BUDGETS[cells[key].device])
                assert outcome["tokens_per_second"] > 0
    missing = sum(side not in rows.get(key, {}) for key in cells for side in consumer.SIDES)
    assert markdown.count("not run (time)") == missing


def test_cited_figures_name_their_source_and_configuration() -> None:
    reported = _script("_consumer_reported")
    assert len(reported.REPORTED) >= 4
    for row in reported.REPORTED:
        assert row["source"].startswith("https://"), row
        assert any(ch.isdigit() for ch in row["figure"]), row
        assert row["configuration"], row
    section = reported.section()
    assert section.count("Source: https://") == len(reported.REPORTED)
    reported.REPORTED.append({"what": "x", "figure": "", "configuration": "y", "source": ""})
    try:
        with pytest.raises(ValueError, match="without a source"):
            reported.section()
    finally:
        reported.REPORTED.pop()


def _wide_vocab_gpt() -> Workload:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=4096))
    generator = torch.Generator().manual_seed(0)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 4096, (size, 33), generator=generator)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    return Workload(model=model, make_batch=make_batch, loss=gpt_loss, name="wide-vocab-gpt")


def test_a_refusal_is_described_by_the_levers_it_names() -> None:
    consumer = _script("consumer")
    cell = consumer.Cell("llama-3.2-1b", "full", 2048, "rtx4090")
    sides = {}
    for name, options in (("before", {"exact_levers": False}), ("after", {"head": []})):
        with pytest.raises(mb.InfeasibleBudgetError) as caught:
            mb.plan(_wide_vocab_gpt(), batch=2, memory="2500KiB", trial=False, policies=["full"], **options)
        sides[name] = consumer.outcome(caught.value, cell)
    before, after = sides["before"], sides["after"]
    assert before["refused"] and after["refused"]
    assert {"FSDP", "CPU offload", "8-bit optimizer", "LoRA / frozen parameters"} <= set(after["levers"])
    assert "CPU offload" not in before["levers"] and "chunked head" not in before["levers"]
    assert consumer.describe(after).startswith("refused, needs >= ")
    assert "FSDP" in consumer.describe(after)
