"""Pipeline parallelism: exactness, per-stage peaks and step time planned vs measured, the 70B plan.

Gloo processes on this machine's CPUs run the built-in GPT cut into stages
(microbatch.distributed.Pipeline on torch.distributed.pipelining):

- exactness: float64, micro-batches of different token counts (labels -100 past a random length),
  one of them short (padded). The gradient of every stage against the single-process full-batch
  gradient, for microbatch's weighting and for torch's recipe (a mean loss per micro-batch, the
  schedule's default scale_grads=True; all micro-batches full, as torch requires);
- memory: float32, the same m micro-batches per step under GPipe and 1F1B: each rank's peak
  (MemoryTracker, one window and the optimizer step, the planner's trial) against the planner's
  per-stage prediction (planner/pipeline/stage_cost.py);
- planned: mb.plan(..., pipeline=S) on 2 ranks (2 stages) and on 4 (2 replicas x 2 stages) for a few
  budgets: each stage's predicted and measured peak and the budget;
- time: the planner's predicted step against the step measured on the CPU clock (each rank's actions
  replayed on the schedule's dependency graph, benchmarks/pipeline_timing.py) and on the wall clock;
- simulated: llama-3.1-70b on 64 H100 (bf16, seq 4096, batch 512), DP x PP x FSDP with 8 stages
  against FSDP over the 64 ranks without a pipeline (`microbatch plan ... --json`).

    python benchmarks/pipeline.py            # prints JSON, writes the RESULTS.md section
    python benchmarks/pipeline.py --quick --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

import pipeline_timing as timing  # benchmarks/pipeline_timing.py
import results  # benchmarks/results.py
from microbatch.distributed.launch import launch
from microbatch.distributed.pipeline import Pipeline
from microbatch.memory import format_bytes
from microbatch.models.gpt import GPT, GPTConfig, token_loss
from microbatch.planner.pipeline.layouts import WINDOW_COLLECTIVES

SECTION = "Pipeline parallelism"
EXACT_CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=16)
EXACT_ROWS = [4, 2, 4, 4, 3, 4, 1, 4]  # rows per micro-batch (full: 4)


def _gpt(config: GPTConfig, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(config).to(dtype)


def _batches(config: GPTConfig, rows: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i, count in enumerate(rows):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        tokens = torch.randint(0, config.vocab_size, (count, config.block_size), generator=g)
        labels = torch.randint(0, config.vocab_size, (count, config.block_size), generator=g)
        lengths = torch.randint(1, config.block_size + 1, (count,), generator=g)
        labels[torch.arange(config.block_size)[None, :] >= lengths[:, None]] = -100
        out.append((tokens, labels))
    return out


def _reference(rows: list[int]) -> dict[str, torch.Tensor]:
    model = _gpt(EXACT_CONFIG, torch.float64)
    batches = _batches(EXACT_CONFIG, rows)
    tokens, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    token_loss(model(tokens), labels)[0].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}  # type: ignore[union-attr]


def exact_rank(m: int) -> dict[str, Any]:
    """This rank's stage gradients: microbatch's weighting (uneven rows) and torch's default (full rows)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    example = torch.zeros(max(EXACT_ROWS), EXACT_CONFIG.block_size, dtype=torch.long)
    pipe = Pipeline(
        _gpt(EXACT_CONFIG, torch.float64), num_stages=2, micro_batches=m, example=example, loss_fn=token_loss
    )
    pipe.backward(_batches(EXACT_CONFIG, EXACT_ROWS))
    ours = {n: p.grad.clone() for n, p in pipe.named_parameters()}  # type: ignore[union-attr]
    full = _batches(EXACT_CONFIG, [max(EXACT_ROWS)] * m)
    split = pipeline(
        _gpt(EXACT_CONFIG, torch.float64),
        mb_args=(full[0][0],),
        split_spec={"blocks.2": SplitPoint.BEGINNING},
    )
    stage = split.build_stage(dist.get_rank(), torch.device("cpu"))
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, labels: token_loss(out, labels)[0])
    tokens, labels = torch.cat([b[0] for b in full]), torch.cat([b[1] for b in full])
    schedule.step(tokens) if dist.get_rank() == 0 else schedule.step(target=labels)
    theirs = {n: p.grad.clone() for n, p in stage.submod.named_parameters() if p.grad is not None}
    return {"ours": ours, "torch": theirs}


def _relative_error(
    grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], blocks_only: bool
) -> float:
    worst = 0.0
    for name, grad in grads.items():
        if blocks_only and not name.startswith("blocks."):
            continue
        worst = max(worst, float((grad - reference[name]).abs().max() / reference[name].abs().max()))
    return worst


def _forced_plan(workload: Any, profile: Any, schedule: str, size: int, m: int, batch: int) -> Any:
    """Rank 0: the planner's plan for this (schedule, micro-batch, m), priced but not searched."""
    from microbatch import distributed
    from microbatch.planner.options import PlanOptions
    from microbatch.planner.outcome import PlanRequest
    from microbatch.planner.pipeline import choose as pipeline_plan
    from microbatch.planner.pipeline import layouts as pipeline_search
    from microbatch.planner.search.splits import WindowSizes

    with distributed.single_process():
        request = PlanRequest(workload, batch, "64GiB", PlanOptions(pipeline=2, profile=profile))
        setup = pipeline_plan.prepare(request)
        chosen = pipeline_search.price(setup.context, schedule, WindowSizes(batch, size), m)
        found = pipeline_search.PipelineSearch(chosen, (chosen,), chosen)
        return pipeline_plan.plan_of(setup, request, found, began=time.perf_counter())


def two_rank(config: dict[str, Any]) -> dict[str, Any]:
    """Every rank of 2: the fixed-m memory cases, the planned budgets, the timed cases."""
    import torch.distributed as dist

    import microbatch as mb
    from microbatch.models.workloads import gpt_workload
    from microbatch.planner.pipeline.on_ranks import stage_peaks
    from microbatch.profile import profile_workload

    workload = gpt_workload(GPTConfig(**config["gpt"]))
    profile = None
    if dist.get_rank() == 0:  # the planner's profile, on the CPU clock (one torch thread per rank)
        profile = profile_workload(workload, clock="cpu", policies=["none", "full"])
    memory = []
    for schedule in ("gpipe", "1f1b"):
        payload = [_forced_plan(workload, profile, schedule, config["rows"], config["m"], config["batch"])]
        dist.broadcast_object_list(payload, src=0)
        plan = payload[0]
        memory.append({"plan": plan.to_dict(), "measured": list(stage_peaks(plan, workload))})
    planned = [
        mb.plan(workload, batch=config["batch"], memory=budget, pipeline=2, profile=profile).to_dict()
        for budget in config["budgets"]
    ]
    return {"memory": memory, "planned": planned, "timing": timing.timing_rank(config["timing"])}


def four_rank(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank of 4 (2 replicas x 2 stages): the planned budgets."""
    import microbatch as mb
    from microbatch.models.workloads import gpt_workload

    workload = gpt_workload(GPTConfig(**config["gpt"]))
    return [
        mb.plan(workload, batch=2 * config["batch"], memory=budget, pipeline=2, world_size=4).to_dict()
        for budget in config["budgets"]
    ]


def simulated_70b() -> dict[str, Any]:
    """`microbatch plan llama-3.1-70b ...` on 64 H100, with 8 pipeline stages and without."""
    base = ["llama-3.1-70b", "--device", "h100-80gb", "--world-size", "64", "--shard", "fsdp"]
    base += ["--batch", "512", "--seq-len", "4096", "--precision", "bf16", "--memory", "76GiB"]
    base += ["--no-progress", "--json"]
    out = {}
    for name, extra in (("pipeline", ["--pipeline", "8"]), ("flat", [])):
        command = [sys.executable, "-m", "microbatch", "plan", *base, *extra]
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ))
        out[name] = json.loads(done.stdout)
    out["command"] = "microbatch plan " + " ".join(base[:-2]) + " [--pipeline 8]"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-simulated", action="store_true", help="leave out the 70B plans (80 s)")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    m = 4
    started = os.getloadavg()
    exact = launch(exact_rank, m, world_size=2, timeout_s=600.0)
    reference_uneven = _reference(EXACT_ROWS)
    reference_full = _reference([max(EXACT_ROWS)] * m)
    gpt = {"n_layer": 4, "n_head": 4, "n_embd": 64 if args.quick else 128, "block_size": 64}
    config = {
        "gpt": gpt,
        "batch": 32,
        "rows": 4,
        "m": 8,
        "budgets": ["64MiB", "16MiB", "10MiB"] if not args.quick else ["64MiB", "6MiB"],
        "timing": {
            "gpt": gpt,
            "batch": 32,
            "windows": 6 if not args.quick else 3,
            "cases": [("1GiB", "1f1b"), ("1GiB", "gpipe"), ("16MiB", None), ("10MiB", None)],
        },
    }
    if args.quick:
        config["timing"]["cases"] = [("1GiB", "1f1b"), ("6MiB", None)]
    two = launch(two_rank, config, world_size=2, timeout_s=1500.0)
    four = launch(four_rank, config, world_size=4, timeout_s=1500.0)
    report = {
        "exact": {
            "ours": max(_relative_error(r["ours"], reference_uneven, False) for r in exact),
            "torch_blocks": max(_relative_error(r["torch"], reference_full, True) for r in exact),
            "torch_all": max(_relative_error(r["torch"], reference_full, False) for r in exact),
        },
        "config": config,
        "memory": two[0]["memory"],
        "planned_2": two[0]["planned"],
        "planned_4": four[0],
        "timing": _timing(two),
        "simulated": None if args.no_simulated else simulated_70b(),
        "load": {"before": started, "after": os.getloadavg()},
    }
    markdown = _markdown(report, m)
    command = results.reproducing_command(
        "pipeline", sys.argv[1:] if argv is None else argv, json_mode=args.json
    )
    markdown += f"\n\nReproduce: `/work/tools/heavy {command}` (heavy: at most one other job beside it)"
    return results.emit(SECTION, markdown, report, json_mode=args.json, write=not args.no_write)


def _timing(two: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per timed case: predicted, replayed (CPU clock) and wall seconds per window."""
    latency, _, collective = two[0]["timing"]["link"]
    rows = []
    for index, case in enumerate(two[0]["timing"]["cases"]):
        ranks = [r["timing"]["cases"][index] for r in two]
        windows = len(ranks[0]["actions"])
        replayed = [
            timing.replay(ranks, w, 2, latency, WINDOW_COLLECTIVES * collective) for w in range(windows)
        ]
        plan = case["plan"]
        rows.append(
            {
                "schedule": plan["pipeline_schedule"],
                "micro_batch_size": plan["micro_batch_size"],
                "m": plan["pipeline_micro_batches"],
                "steps": plan["steps"],
                "predicted": plan["predicted_seconds_per_step"],
                "replayed": timing.median(replayed),
                "wall": max(timing.median(r["measured"]["wall"]) for r in ranks),
                "cpu": [timing.median(r["measured"]["cpu"]) for r in ranks],
                "policies": sorted(set(plan["policies"].values())),
            }
        )
    return rows


# markdown
def _exactness_lines(exact: dict[str, float], m: int) -> list[str]:
    rows = [
        [
            "microbatch Pipeline (items_i / global_items)",
            f"{len(EXACT_ROWS)} of 1-4 rows, 2 steps",
            exact["ours"],
        ],
        [
            "torch ScheduleGPipe, default scale_grads (blocks)",
            f"{m} full (uneven refused)",
            exact["torch_blocks"],
        ],
        ["torch ScheduleGPipe, default (all parameters)", f"{m} full", exact["torch_all"]],
    ]
    return [
        "Built-in GPT in 2 stages on 2 gloo processes (torch.distributed.pipelining). Exactness: float64, "
        f"{EXACT_CONFIG.n_layer} layers, width {EXACT_CONFIG.n_embd}, sequences of {EXACT_CONFIG.block_size} "
        "tokens with random lengths (labels -100 after); max |g - g_full| / max |g_full| over each stage's "
        "parameters against the single-process full-batch gradient of the mean token loss. torch's "
        "'all parameters' row also misses the tied embedding / head copies, which it leaves unsummed.",
        "",
        results.markdown_table(
            ["recipe", "micro-batches", "max relative error"], [[a, b, f"{c:.1e}"] for a, b, c in rows]
        ),
        "",
    ]


def _pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:+.1f} %"


def _memory_lines(report: dict[str, Any]) -> list[str]:
    config = report["config"]
    gpt = config["gpt"]
    rows = []
    for case in report["memory"]:
        plan = case["plan"]
        for stage, (guess, seen) in enumerate(zip(plan["stage_peak_bytes"], case["measured"], strict=True)):
            k = (
                min(plan["pipeline_micro_batches"], 2 - stage)
                if plan["pipeline_schedule"] == "1f1b"
                else config["m"]
            )
            rows.append(
                [
                    plan["pipeline_schedule"],
                    stage,
                    k,
                    format_bytes(seen),
                    f"{format_bytes(guess)} ({_pct(guess, seen)})",
                ]
            )
    first, second = ([c["measured"][s] for c in report["memory"]] for s in (0, 1))  # [GPipe, 1F1B]
    return [
        f"Memory: float32 GPT, {gpt['n_layer']} layers, width {gpt['n_embd']}, block {gpt['block_size']}, "
        f"m = {config['m']} micro-batches of {config['rows']} sequences per step, both schedules. Measured: "
        "each rank's peak live tensor bytes over one window and its AdamW step, the optimizer state made "
        "before (the planner's trial on the ranks, MemoryTracker). Predicted: the planner's stage model "
        "(planner/pipeline/stage_cost.py: the Profile's segments per stage, k micro-batches in flight).",
        "",
        results.markdown_table(["schedule", "stage", "in flight k", "measured", "predicted"], rows),
        "",
        f"GPipe / 1F1B at the same m: {first[0] / first[1]:.2f}x on stage 0, "
        f"{second[0] / second[1]:.2f}x on stage 1.",
        "",
    ]


def _planned_rows(plans: list[dict[str, Any]], ranks: int) -> list[list[Any]]:
    rows = []
    for plan in plans:
        measured = plan["measured_stage_peak_bytes"]
        split = f"{plan['micro_batch_size']} x {plan['steps']}, m = {plan['pipeline_micro_batches']}"
        checkpointed = sum(1 for p in plan["policies"].values() if p != "none")
        for stage, guess in enumerate(plan["stage_peak_bytes"]):
            seen = measured[stage]
            rows.append(
                [
                    ranks,
                    format_bytes(plan["budget_bytes"]),
                    f"{plan['pipeline_schedule']}, {split}",
                    checkpointed,
                    stage,
                    format_bytes(seen),
                    f"{format_bytes(guess)} ({_pct(guess, seen)})",
                    "yes" if seen <= plan["budget_bytes"] else "NO",
                ]
            )
    return rows


def _planned_lines(report: dict[str, Any]) -> list[str]:
    rows = _planned_rows(report["planned_2"], 2) + _planned_rows(report["planned_4"], 4)
    errors = [abs(float(r[6].split("(")[1].split(" ")[0])) for r in rows]
    return [
        "Planned: `mb.plan(workload, batch=32 (64 on 4 ranks), memory=M, pipeline=2)` called on every rank "
        "(every rank profiles at once and rank 0 searches on its own profile; every rank proves its own "
        "stage in the trial window). 4 ranks are "
        "2 data-parallel replicas x 2 stages; a stage's measured peak is its worse replica's.",
        "",
        results.markdown_table(
            [
                "ranks",
                "budget",
                "plan",
                "blocks checkpointed",
                "stage",
                "measured",
                "predicted",
                "within budget",
            ],
            rows,
        ),
        "",
        f"Largest |predicted - measured| / measured: {max(errors):.1f} %.",
        "",
    ]


def _timing_lines(report: dict[str, Any]) -> list[str]:
    rows = []
    for row in report["timing"]:
        split = f"{row['schedule']}, {row['micro_batch_size']} x {row['steps']}, m = {row['m']}"
        rows.append(
            [
                split,
                ", ".join(row["policies"]),
                f"{row['predicted']:.3f}",
                f"{row['replayed']:.3f}",
                f"{row['replayed'] / row['predicted']:.2f}",
                f"{row['wall']:.3f}",
                f"{row['wall'] / row['predicted']:.2f}",
                " / ".join(f"{c:.3f}" for c in row["cpu"]),
            ]
        )
    load = report["load"]
    return [
        "Step time on 2 ranks (2 stages), seconds per window (forward, backward, the window's sums and the "
        "AdamW step). Predicted: the plan's (m + S - 1) x the slowest stage's micro-batch (its Profile "
        "segments on the CPU clock, recompute included) + 2 messages per slot + the optimizer step + the "
        "window's small collectives, with the link the ranks measured. Measured on the CPU clock: each "
        "rank's forwards and backwards (time.thread_time) replayed on the schedule's dependency graph plus "
        "its CPU outside them, the optimizer step and the collectives (what the window takes with a core "
        "per rank); and on the wall clock (the slower rank), which also holds other jobs' time slices.",
        "",
        results.markdown_table(
            [
                "plan",
                "policies",
                "predicted s",
                "measured s (CPU)",
                "CPU / predicted",
                "wall s",
                "wall / predicted",
                "CPU s per rank",
            ],
            rows,
        ),
        "",
        f"Load average (1, 5, 15 min) {tuple(round(x, 2) for x in load['before'])} before, "
        f"{tuple(round(x, 2) for x in load['after'])} after; run under /work/tools/heavy (at most one other "
        "heavy job beside it) on 2 cores shared with other sessions.",
        "",
    ]


def _simulated_lines(report: dict[str, Any]) -> list[str]:
    simulated = report["simulated"]
    if simulated is None:
        return []
    pp, flat = simulated["pipeline"], simulated["flat"]
    stages = [
        [s, name, format_bytes(peak)]
        for s, (name, peak) in enumerate(
            zip(["(first block)", *pp["stage_starts"]], pp["stage_peak_bytes"], strict=True)
        )
    ]
    verdict = next((n for n in pp["notes"] if n.startswith("without a pipeline")), "")
    step = next((n for n in pp["notes"] if n.startswith("pipeline step time")), "")

    def summary(plan: dict[str, Any]) -> list[Any]:
        checkpointed = sum(1 for p in plan["policies"].values() if p != "none")
        return [
            f"{plan['micro_batch_size']} x {plan['steps']}",
            plan.get("pipeline_schedule") or "-",
            plan.get("pipeline_micro_batches") or "-",
            f"{checkpointed} of {len(plan['policies'])}",
            format_bytes(plan["predicted_peak_bytes"]),
            f"{plan['predicted_seconds_per_step']:.1f}",
        ]

    return [
        f"Simulated: `{simulated['command']}` (the 80 GiB card reports 79.65 GiB, so the budget is 76 GiB). "
        "With a pipeline: 8 stages x 8 replicas, FSDP2 within each stage's 8-rank group (torch's stage keeps "
        "an FSDP2 stage unsharded from its first backward to the step's end); without: FSDP2 over all 64.",
        "",
        results.markdown_table(
            [
                "layout",
                "micro-batch x steps",
                "schedule",
                "m",
                "blocks checkpointed",
                "peak per rank",
                "s / step",
            ],
            [["DP 8 x PP 8 x FSDP 8", *summary(pp)], ["FSDP 64", *summary(flat)]],
        ),
        "",
        results.markdown_table(["stage", "from", "predicted peak"], stages),
        "",
        f"{step}. {verdict}. (The note prices the plan without a pipeline from the pipeline's profile, "
        "micro-batches up to 16 per replica's 64 rows; the table's FSDP 64 row is its own plan, profiled up "
        "to the 8 rows per rank, hence the small difference in its peak.)",
        "",
    ]


def _markdown(report: dict[str, Any], m: int) -> str:
    lines = _exactness_lines(report["exact"], m)
    lines += _memory_lines(report) + _planned_lines(report) + _timing_lines(report) + _simulated_lines(report)
    lines.append(results.environment_line())
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
