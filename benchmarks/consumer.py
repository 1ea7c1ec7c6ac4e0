"""The consumer-GPU table (issue 34): Llama 3.x fine-tuning on an RTX 4090 and an A100 40 GB, simulated.

Full fine-tuning (precision "mixed": float32 weights, gradients and AdamW state, bf16 autocast, as
the issue's command) and LoRA (rank LORA_RANK on every attention and MLP projection through peft,
bfloat16 frozen base weights and float32 adapters, as torchtune and unsloth run it) of llama-3.2-1b,
llama-3.2-3b and llama-3.1-8b at 2,048 and 8,192 tokens a sequence, 262,144 tokens a step (128 and 32
sequences), on the rtx4090 and a100-40gb presets, each planned twice from one simulated profile:

- **before**: ``exact_levers=False``, the planner before issue 34 (no loss head in chunks, the
  optimizer's own step, a refusal that names no exact lever);
- **after**: as ``microbatch plan`` plans today (the head in chunks and the step's implementation as
  choices, refusals that name the exact levers first).

Cells run one at a time and each is kept in ``--rows`` (benchmarks/consumer_rows.json) as it ends, so
a partial run is not lost; a cell already there is not run again unless ``--rerun``. ``--only``
picks cells by substring ("1b/full/2048/rtx4090"); ``--dry-run`` lists the cells and rewrites the
section from the rows kept; ``--quick`` (``microbatch bench --quick``) runs none. What people
report on such cards is in _consumer_reported.py.

    flock /tmp/microbatch-heavy.lock env PYTHONPATH=src python benchmarks/consumer.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _consumer_reported as reported
import results

ROWS_PATH = Path(__file__).resolve().parent / "consumer_rows.json"
TITLE = "Consumer GPUs: Llama 3.x fine-tuning before and after the exact levers (issue 34)"
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")
TRAININGS = ("full", "lora")
# One step's tokens at each length: 128 x 2,048 = 32 x 8,192 = 262,144.
BATCHES = {2048: 128, 8192: 32}
# Each card's memory less about 1 GiB for what no plan controls (the 23GiB on a 24 GiB card).
BUDGETS = {"rtx4090": "23GiB", "a100-40gb": "39GiB"}
LORA_RANK = 16
# before: exact_levers=False; after: as planned today; priced: the head's chunks priced always.
SIDES = ("before", "after", "priced")
PRECISIONS = {"full": "mixed", "lora": "bf16"}
# What a refusal names, in the words the planner uses (before issue 34 and after).
LEVERS = {
    "chunked head": r"loss head in chunks",
    "fused step": r"fused optimizer step",
    "FSDP": r"FSDP over (at least )?\d+ ranks|FSDP across more ranks",
    "CPU offload": r"CPU offload",
    "8-bit optimizer": r"8-bit optimizer",
    "stateless optimizer": r"stateless",
    "LoRA / frozen parameters": r"LoRA|frozen parameters",
}


@dataclass(frozen=True)
class Cell:
    model: str
    training: str
    seq_len: int
    device: str

    @property
    def key(self) -> str:
        return f"{self.model}/{self.training}/{self.seq_len}/{self.device}"

    @property
    def batch(self) -> int:
        return BATCHES[self.seq_len]


def cells() -> list[Cell]:
    """Every cell in the order they run (_cost_order)."""
    every = [
        Cell(model, training, seq_len, device)
        for model in MODELS
        for training in TRAININGS
        for seq_len in BATCHES
        for device in BUDGETS
    ]
    return sorted(every, key=_cost_order)


def _cost_order(cell: Cell) -> tuple[bool, bool, int]:
    """The issue's case first, then the full fine-tunes the weights alone refuse (cheap), then by size."""
    cheap = cell.training == "full" and cell.model != "llama-3.2-1b"
    return (cell.key != "llama-3.2-1b/full/2048/rtx4090", not cheap, MODELS.index(cell.model))


def outcome(plan_or_error: Any, cell: Cell) -> dict[str, Any]:
    """A plan's split, checkpointing, head, step, peak and tokens/s; or a refusal and what it names."""
    from microbatch.errors import InfeasibleBudgetError
    from microbatch.planner.result.text import summarize_policies

    if isinstance(plan_or_error, InfeasibleBudgetError):
        message = str(plan_or_error)
        return {
            "refused": True,
            "first_line": message.split(". ")[0][:300],
            "levers": [name for name, pattern in LEVERS.items() if re.search(pattern, message)],
            "minimum_bytes": plan_or_error.minimum_bytes,
            "message": message,
        }
    plan = plan_or_error
    return {
        "refused": False,
        "micro_batch_size": plan.micro_batch_size,
        "steps": plan.steps,
        "checkpointing": summarize_policies(list(plan.policies.items())),
        "head_chunk_tokens": plan.head_chunk_tokens,
        "optimizer_step": plan.optimizer_step,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "tokens_per_second": cell.batch * cell.seq_len / plan.predicted_seconds_per_step,
    }


def _planned(workload: Any, cell: Cell, **options: Any) -> dict[str, Any]:
    import microbatch as mb
    from microbatch.memory.device_specs import device_spec

    try:
        plan = mb.plan(
            workload,
            batch=cell.batch,
            memory=BUDGETS[cell.device],
            device=device_spec(cell.device),
            **options,
        )
    except mb.InfeasibleBudgetError as error:
        return outcome(error, cell)
    return outcome(plan, cell)


def run_cell(cell: Cell) -> dict[str, Any]:
    """Before and after for one cell, from one simulated profile (none when the weights alone refuse)."""
    from microbatch.errors import InfeasibleBudgetError
    from microbatch.hf.configs import ModelSetup, config_workload, simulate_config_profile
    from microbatch.memory import parse_bytes
    from microbatch.memory.device_specs import device_spec
    from microbatch.planner.levers.head_choice import AUTO_HEAD_CHUNKS
    from microbatch.planner.refusals import refuse_budget_below_weights

    began = time.perf_counter()
    setup = ModelSetup(
        seq_len=cell.seq_len,
        precision=PRECISIONS[cell.training],
        lora_rank=LORA_RANK if cell.training == "lora" else 0,
    )
    spec = device_spec(cell.device)
    workload = config_workload(cell.model, setup)
    try:  # the whole budget: the planner's own check (less the reserve) refuses too, before profiling
        refuse_budget_below_weights(workload, parse_bytes(BUDGETS[cell.device]))
    except InfeasibleBudgetError:
        before = _planned(workload, cell, exact_levers=False)
        after = _planned(workload, cell)
        priced = _planned(workload, cell, head=list(AUTO_HEAD_CHUNKS))
        return {"before": before, "after": after, "priced": priced, "seconds": time.perf_counter() - began}
    simulate = {"max_micro_batch_size": min(cell.batch, 16)}
    workload, profile = simulate_config_profile(cell.model, setup, spec, **simulate)
    heads: dict[int, Any] = {}

    def head_profile(tokens: int) -> Any:  # the same simulation with the loss head in chunks
        if tokens not in heads:
            heads[tokens] = simulate_config_profile(
                cell.model, setup, spec, head_chunk_tokens=tokens, **simulate
            )[1]
        return heads[tokens]

    before = _planned(workload, cell, profile=profile, exact_levers=False)
    after = _planned(workload, cell, profile=profile, head_profile=head_profile)
    # The head's chunks priced whether or not a plan fits without them: faster plans the auto rule leaves.
    chunks = list(AUTO_HEAD_CHUNKS)
    priced = _planned(workload, cell, profile=profile, head_profile=head_profile, head=chunks)
    return {"before": before, "after": after, "priced": priced, "seconds": time.perf_counter() - began}


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def describe(side: dict[str, Any] | None) -> str:
    """One table cell: the plan and its predictions, or the refusal and the levers it names."""
    if side is None:
        return "not run (time)"
    if side["refused"]:
        names = ", ".join(side["levers"]) or "no lever"
        taken = re.search(r"already taken: ([^)]*)\)", side["message"])
        took = f"; took {taken.group(1)}" if taken else ""
        return f"refused, needs >= {_gib(side['minimum_bytes'])}{took}; names: {names}"
    head = f"head chunks {side['head_chunk_tokens']:,}" if side["head_chunk_tokens"] else "head whole"
    step = f"{side['optimizer_step']} step" if side["optimizer_step"] else "own step"
    return (
        f"{side['micro_batch_size']} x {side['steps']}, {side['checkpointing']}, {head}, {step}; "
        f"peak {_gib(side['predicted_peak_bytes'])}, {side['tokens_per_second']:,.0f} tokens/s"
    )


def _refusal_lines(key: str, row: dict[str, Any]) -> list[str]:
    """'- key before: first line', one line for both sides when they refuse alike."""
    sides = [side for side in ("before", "after") if row.get(side, {}).get("refused")]
    refused = {side: row[side]["first_line"] for side in sides}
    if len(refused) == 2 and refused["before"] == refused["after"]:
        return [f"- {key} before and after: {refused['before']}"]
    return [f"- {key} {side}: {line}" for side, line in refused.items()]


def summary(rows: dict[str, Any]) -> str:
    """What the levers changed across the cells kept: newly planned, still refused, unchanged."""
    kept = {key: row for key, row in rows.items() if not key.startswith("_")}
    planned = [key for key, row in kept.items() if row["before"]["refused"] and not row["after"]["refused"]]
    both = [key for key, row in kept.items() if row["before"]["refused"] and row["after"]["refused"]]
    lower = [
        f"{key} ({_gib(kept[key]['before']['minimum_bytes'])} -> {_gib(kept[key]['after']['minimum_bytes'])})"
        for key in both
        if kept[key]["after"]["minimum_bytes"] < kept[key]["before"]["minimum_bytes"]
    ]
    fitting = [key for key, row in kept.items() if not row["after"]["refused"]]
    same = [key for key in fitting if kept[key]["before"] == kept[key]["after"]]
    return (
        f"{len(kept)} of 24 cells run. Refused before, planned after: {', '.join(planned) or 'none'}. "
        f"Refused both times: {len(both)}, of them with a lower minimum after: {', '.join(lower) or 'none'}. "
        f"Planned both times, the same plan: {len(same)} (the levers are tried only when no plan fits). "
        f"{_priced_summary(kept)}"
    )


def _priced_summary(kept: dict[str, Any]) -> str:
    """Where pricing the head's chunks always gives a faster plan than the default rule."""
    faster = []
    for key, row in kept.items():
        after, priced = row["after"], row.get("priced")
        if priced is None or after["refused"] or priced["refused"]:
            continue
        if priced["tokens_per_second"] > after["tokens_per_second"] * 1.001:
            ratio = priced["tokens_per_second"] / after["tokens_per_second"]
            faster.append(f"{key} ({ratio:.2f}x)")
    return f"With the head's chunks priced always, faster: {', '.join(faster) or 'none'}."


def table(rows: dict[str, Any]) -> str:
    """The section's markdown: the planned cells, the first refusal lines, then what people report."""
    body = []
    refusals = []
    for cell in sorted(cells(), key=lambda c: (MODELS.index(c.model), c.training, c.seq_len, c.device)):
        row = rows.get(cell.key, {})
        size = f"{cell.seq_len:,} x {cell.batch}"
        card = f"{cell.device} ({BUDGETS[cell.device]})"
        sides = [describe(row.get("before")), describe(row.get("after")), describe(row.get("priced"))]
        if "priced" in row and row["priced"] == row["after"]:
            sides[2] = "same as after"
        body.append([cell.model, cell.training, size, card, *sides])
        refusals += _refusal_lines(cell.key, row)
    headers = ["Model", "Training", "Tokens x batch", "Card (budget)", "Before issue 34", "After issue 34"]
    headers.append("After, head chunks priced always")
    environment = rows.get("_environment", "not run")
    lines = [
        f"Simulated plans (fake tensors on the device presets, no kernel run), planned on {environment}.",
        "Full: precision mixed (float32 weights, gradients, AdamW state; bf16 autocast). "
        f"LoRA: rank {LORA_RANK} on q/k/v/o/gate/up/down (peft), bfloat16 frozen base weights, "
        "float32 adapters (peft's default) and AdamW on them alone. 262,144 tokens a step. "
        "Before: `exact_levers=False`; after: the planner as it is; the last column: after, with "
        "`head=[256, 1024, 4096]` (the head's chunks priced even when a plan fits without them, which "
        "the default prices only when none does). A plan: micro-batch x steps, "
        "checkpointing per block, the loss head, the optimizer step (own: AdamW's foreach on CUDA); "
        "its predicted peak and tokens/s.",
        "",
        summary(rows),
        "",
        results.markdown_table(headers, body),
        "",
        "Refusals' first lines:",
        "",
        *refusals,
        "",
        reported.section(),
        "",
        f"Remake: `flock /tmp/microbatch-heavy.lock env PYTHONPATH=src python benchmarks/consumer.py` "
        f"(cells kept in benchmarks/{ROWS_PATH.name}).",
    ]
    return "\n".join(lines)


def load_rows(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="run only the cells whose key contains this substring")
    parser.add_argument("--rows", type=Path, default=ROWS_PATH, help="the JSON the cells are kept in")
    parser.add_argument("--rerun", action="store_true", help="run cells already kept again")
    parser.add_argument(
        "--dry-run", action="store_true", help="list the cells; rewrite the section from the rows"
    )
    parser.add_argument("--quick", action="store_true", help="run no cell: the section from the rows kept")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    rows = load_rows(args.rows)
    for cell in cells():
        done = cell.key in rows and all(side in rows[cell.key] for side in SIDES)
        if args.only not in cell.key or (done and not args.rerun):
            continue
        if args.dry_run or args.quick:
            print(f"would run {cell.key} (batch {cell.batch}, {BUDGETS[cell.device]})", file=sys.stderr)
            continue
        print(f"running {cell.key}", file=sys.stderr, flush=True)
        rows[cell.key] = run_cell(cell)
        rows["_environment"] = results.environment_line()
        args.rows.write_text(json.dumps(rows, indent=1, default=str) + "\n", encoding="utf-8")
        for side in SIDES:
            print(f"  {side}: {describe(rows[cell.key][side])}", file=sys.stderr)
    report = {"cells": {key: value for key, value in rows.items() if not key.startswith("_")}}
    return results.emit(TITLE, table(rows), report, json_mode=args.json, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
