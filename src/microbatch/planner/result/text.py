"""How a ``Plan`` reads as text: ``print(plan)``'s lines, the block table and the frontier table.

Kept apart from plans.py (the data and its use) so that the wording can grow without the
dataclass growing. Nothing here computes a plan: every number comes from the Plan's fields.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ...memory import format_bytes
from ..search.splits import describe_split

# The functions take a plans.Plan; typed Any because plans.py imports this module (no circle).
Plan = Any

NONE = "none"
# print(plan) shows this many frontier rows around the chosen one; to_dict() holds them all.
SHOWN_FRONTIER_ROWS = 10
# A run of at least this many numbered blocks (model.layers.0 .. model.layers.31) is one table line.
GROUPED_BLOCKS = 5
# The block column is at least this wide, wider when a name (a LoRA model's) is longer.
BLOCK_COLUMN = 28
_NUMBERED = re.compile(r"^(?P<stem>.*?)(?P<index>\d+)$")


def summarize_policies(block_policies: Sequence[tuple[str, str]]) -> str:
    """'full x3, none x9' (counts in block order of first appearance); 'no blocks' when empty."""
    if not block_policies:
        return "no blocks"
    counts = Counter(policy for _, policy in block_policies)
    return ", ".join(f"{policy} x{count}" for policy, count in counts.items())


def block_rows(block_policies: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(block, policy) rows; a run of GROUPED_BLOCKS or more numbered blocks becomes one row.

    ``model.layers.0 .. model.layers.31`` with layer 0 recomputed reads
    ``("model.layers.0-31", "none x31, full x1 (full: 0)")``: the counts, then which blocks hold
    each policy but the most common one, so nothing the table said before is lost.
    """
    rows: list[tuple[str, str]] = []
    run: list[tuple[str, int, str]] = []  # (stem, index, policy) of consecutive numbered blocks

    def flush() -> None:
        if len(run) >= GROUPED_BLOCKS:
            rows.append(_grouped_row(run))
        else:
            rows.extend((f"{stem}{index}", policy) for stem, index, policy in run)
        run.clear()

    for name, policy in block_policies:
        match = _NUMBERED.match(name)
        if match is None:
            flush()
            rows.append((name, policy))
            continue
        stem, index = match["stem"], int(match["index"])
        if run and (run[-1][0] != stem or run[-1][1] + 1 != index):
            flush()
        run.append((stem, index, policy))
    flush()
    return rows


def _grouped_row(run: Sequence[tuple[str, int, str]]) -> tuple[str, str]:
    stem = run[0][0]
    counts = Counter(policy for _, _, policy in run)
    summary = ", ".join(f"{policy} x{count}" for policy, count in counts.most_common())
    common = counts.most_common(1)[0][0]
    others = [
        f"{policy}: " + ", ".join(str(index) for _, index, p in run if p == policy)
        for policy in counts
        if policy != common
    ]
    if others:
        summary += " (" + "; ".join(others) + ")"
    return f"{stem}{run[0][1]}-{run[-1][1]}", summary


def block_table(block_policies: Sequence[tuple[str, str]]) -> list[str]:
    """The block table's lines, its first column as wide as its longest name."""
    rows = block_rows(block_policies)
    width = max([BLOCK_COLUMN, *(len(name) + 1 for name, _ in rows)])
    return [f"  {name:<{width}} {policy}" for name, policy in rows]


def ranks_word(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def plan_text(plan: Plan) -> str:
    """``print(plan)``: the split, the budget and peak, the block table, the frontier, the notes."""
    sizes = plan.micro_batch_sizes
    split = f"{plan.micro_batch_size} x {plan.steps} steps"
    if len(set(sizes)) > 1:
        split = f"{describe_split(sizes)} (steps={plan.steps})"
    ranks = f" x {plan.world_size} ranks" if plan.world_size > 1 else ""
    if plan.pipeline_stages > 1:
        ranks = f" x {plan.world_size} replica(s), each {plan.pipeline_stages} pipeline stages"
    head = f"Plan for {plan.workload}: batch {plan.batch_size} = micro-batch {split}{ranks}"
    if plan.source == "manual":
        return "\n".join([f"{head} (manual: nothing predicted)", *block_table(plan.block_policies)])
    measured = (
        f", measured {format_bytes(plan.measured_peak_bytes)}" if plan.measured_peak_bytes is not None else ""
    )
    token_line = (
        [f"  token budget: max_tokens={plan.max_tokens} padded tokens per micro-batch"]
        if plan.max_tokens
        else []
    )
    lines = [
        head,
        f"  budget {format_bytes(plan.budget_bytes)}: "
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)}{measured}",
        f"  predicted {plan.predicted_seconds_per_step:.3g} s per optimizer step, "
        f"{plan.samples_per_second:.1f} samples/s",
        *token_line,
        *pipeline_lines(plan),
        *options_line(plan),
        "  peak = " + " + ".join(f"{name} {format_bytes(v)}" for name, v in plan.peak_parts if v),
        "",
        f"  {'block':<{BLOCK_COLUMN}} policy",
        *block_table(plan.block_policies),
        *report_lines(plan),
        *frontier_lines(plan),
        *(f"note: {note}" for note in plan.notes),
    ]
    return "\n".join(lines)


def pipeline_lines(plan: Plan) -> list[str]:
    """A pipeline plan's layout, schedule and per-stage peaks (predicted, and measured on the ranks)."""
    stages = plan.pipeline_stages
    if stages <= 1:
        return []
    m = plan.pipeline_micro_batches
    per_window = -(-plan.steps // m)
    lines = [
        f"  pipeline: {stages} stages x {plan.world_size} replica(s) = {stages * plan.world_size} ranks, "
        f"{plan.pipeline_schedule}, {m} micro-batches per pipeline step, {per_window} step(s) per window, "
        f"bubble {plan.bubble_fraction:.0%}"
    ]
    starts = ["(first block)", *plan.stage_starts]
    measured = plan.measured_stage_peak_bytes
    for s in range(stages):
        peak = format_bytes(plan.stage_peak_bytes[s]) if plan.stage_peak_bytes else "?"
        seen = f", measured {format_bytes(measured[s])}" if measured else ""
        lines.append(f"    stage {s} from {starts[s]}: predicted peak {peak}{seen}")
    return lines


def options_line(plan: Plan) -> list[str]:
    """The memory-changing options the plan was made with (plan.apply holds to them), when any."""
    made = [f"accumulate_dtype={plan.accumulate_dtype}"] if plan.accumulate_dtype else []
    made += ["scaler (GradScaler)"] if plan.scaler else []
    made += [f"max_grad_norm={plan.max_grad_norm:g}"] if plan.max_grad_norm is not None else []
    lines = [f"  made with: {', '.join(made)}"] if made else []
    if plan.head_chunk_tokens is not None:  # exact levers (planner/levers/): the gradient is unchanged
        lines.append(f"  head: chunks of {plan.head_chunk_tokens:,} tokens (never all logits alive at once)")
    if plan.optimizer_step is not None:
        lines.append(f"  optimizer step: {plan.optimizer_step} (the same update, fewer temporaries)")
    return lines


def report_lines(plan: Plan) -> list[str]:
    """A simulated or sharded plan's per-rank breakdown and the estimates beside it."""
    lines: list[str] = []
    if plan.simulated or plan.shard != "none":
        what = "simulated" if plan.simulated else "profiled"
        where = f"{what} on {plan.device_name}, shard {plan.shard}, {ranks_word(plan.world_size)}"
        if plan.pipeline_stages > 1:
            ranks = plan.world_size * plan.pipeline_stages
            where = f"{what} on {plan.device_name}, shard {plan.shard}, {ranks_word(ranks)}, the worst stage"
        elif plan.shard == "fsdp":
            where += f", gradient sync every {plan.gradient_sync}"
        lines += ["", f"Per rank ({where}):"]
        lines.extend(f"  {name:<52} {format_bytes(value):>10}" for name, value in plan.rank_parts if value)
    if plan.estimates:
        lines += ["", f"Beside other estimates (micro-batch {plan.micro_batch_size}, one rank, unsharded):"]
        lines.extend(f"  {name:<52} {format_bytes(value):>10}" for name, value in plan.estimates)
    return lines


def frontier_rows(plan: Plan) -> tuple[list[tuple[int, int, str, int, float]], int, bool]:
    """(micro, steps, policies, peak, s/step) rows fastest first, the chosen row's index, and
    whether the chosen plan is itself on the frontier.

    The planner picks among plans within its tie fraction of the fastest the one that recomputes
    least (search.choose), which another tied plan may dominate; such a choice is not on the
    frontier, so it gets its own row, placed by its time, rather than marking somebody else's.
    """
    rows = [
        (
            p.micro_batch_size,
            p.steps,
            summarize_policies(p.block_policies),
            p.predicted_peak_bytes,
            p.seconds_per_step,
        )
        for p in plan.frontier
    ]
    for index, point in enumerate(plan.frontier):
        if (point.micro_batch_size, point.steps, point.block_policies) == (
            plan.micro_batch_size,
            plan.steps,
            plan.block_policies,
        ):
            return rows, index, True
    chosen = (
        plan.micro_batch_size,
        plan.steps,
        summarize_policies(plan.block_policies),
        plan.predicted_peak_bytes,
        plan.predicted_seconds_per_step,
    )
    index = next((i for i, row in enumerate(rows) if row[4] > chosen[4]), len(rows))
    rows.insert(index, chosen)
    return rows, index, False


def frontier_lines(plan: Plan) -> list[str]:
    """At most SHOWN_FRONTIER_ROWS frontier rows, centred on the chosen plan, which is marked *."""
    if not plan.frontier:
        return []
    rows, chosen_index, on_frontier = frontier_rows(plan)
    start = max(0, min(chosen_index - SHOWN_FRONTIER_ROWS // 2, len(rows) - SHOWN_FRONTIER_ROWS))
    shown = rows[start : start + SHOWN_FRONTIER_ROWS]
    width = max([BLOCK_COLUMN, *(len(row[2]) + 1 for row in shown)])
    lines = ["", "Frontier (no alternative is both faster and smaller; * = chosen):"]
    lines.append(f"    {'micro':>6} {'steps':>6}  {'policies':<{width}} {'peak':>10} {'s/step':>9}")
    for index, (micro, steps, policies, peak_bytes, seconds) in enumerate(shown, start=start):
        lines.append(
            f"  {'*' if index == chosen_index else ' '} {micro:>6} {steps:>6}  {policies:<{width}} "
            f"{format_bytes(peak_bytes):>10} {seconds:>9.3g}"
        )
    if len(shown) < len(rows):
        lines.append(f"    ... {len(plan.frontier)} frontier rows in all (to_dict(), --json, --plot)")
    if not on_frontier:
        lines.append(
            "    * is not on the frontier itself: among the plans within the tie fraction of the fastest "
            "that fits, the planner takes the one that recomputes least"
        )
    return lines
