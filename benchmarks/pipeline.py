"""Pipeline parallelism: exactness against torch's own loss scaling, and 1F1B vs GPipe memory.

Two gloo processes on this machine's CPUs run the built-in GPT cut into 2 stages
(microbatch.distributed.Pipeline on torch.distributed.pipelining):

- exactness: float64, micro-batches of different token counts (labels -100 past a random length),
  one of them short (padded). The gradient of every stage against the single-process full-batch
  gradient, for microbatch's weighting and for torch's recipe (a mean loss per micro-batch, the
  schedule's default scale_grads=True; all micro-batches full, as torch requires);
- memory: float32, the same m micro-batches per step under GPipe and 1F1B; each rank's peak live
  tensor bytes (MemoryTracker) over a window's forward and backward, and seconds per window
  (the fastest of a few, alternating the schedules).

    python benchmarks/pipeline.py            # prints JSON, writes the RESULTS.md section
    python benchmarks/pipeline.py --quick --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import results  # benchmarks/results.py
from microbatch.distributed.launch import launch
from microbatch.distributed.pipeline import Pipeline
from microbatch.memory import MemoryTracker, format_bytes
from microbatch.models.gpt import GPT, GPTConfig, token_loss
from microbatch.planner.pipeline import predict_pipeline, profile_stages

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


def memory_rank(config: dict[str, Any]) -> dict[str, Any]:
    """Peak live bytes and seconds per window of this rank's stage, GPipe and 1F1B alternating."""
    gpt = GPTConfig(**config["gpt"])
    m, rows, rounds = config["m"], config["rows"], config["rounds"]
    torch.manual_seed(0)
    example = torch.zeros(rows, gpt.block_size, dtype=torch.long)
    pipes = {
        name: Pipeline(
            _gpt(gpt, torch.float32),
            num_stages=2,
            micro_batches=m,
            example=example,
            loss_fn=token_loss,
            schedule=name,
        )
        for name in ("gpipe", "1f1b")
    }
    data = _batches(gpt, [rows] * m, seed=1)
    peaks: dict[str, int] = {}
    seconds: dict[str, list[float]] = {name: [] for name in pipes}
    for round_index in range(rounds):
        for name, pipe in pipes.items():
            start = time.perf_counter()
            if round_index == 0:  # the first window: measured, not timed (the tracker slows it)
                with MemoryTracker(torch.device("cpu")) as tracker:
                    pipe.backward(data)
                peaks[name] = int(tracker.peak_bytes)
            else:
                pipe.backward(data)
                seconds[name].append(time.perf_counter() - start)
            for p in pipe.parameters():
                p.grad = None
    return {"peaks": peaks, "seconds": {name: min(values) for name, values in seconds.items()}}


def predict_memory(config: dict[str, Any]) -> dict[str, Any]:
    """The planner's prediction for the memory run, from one process (planner/pipeline.py)."""
    gpt = GPTConfig(**config["gpt"])
    data = _batches(gpt, [config["rows"]], seed=1)[0]
    model = _gpt(gpt, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (launch gives every process one thread)
    try:
        costs = profile_stages(model, num_stages=2, example=data[0], labels=data[1], loss_fn=token_loss)
    finally:
        torch.set_num_threads(threads)
    return {
        name: predict_pipeline(costs, micro_batches=config["m"], schedule=name).to_dict()
        for name in ("gpipe", "1f1b")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    m = 4
    exact = launch(exact_rank, m, world_size=2, timeout_s=600.0)
    reference_uneven = _reference(EXACT_ROWS)
    reference_full = _reference([max(EXACT_ROWS)] * m)
    ours = max(_relative_error(r["ours"], reference_uneven, False) for r in exact)
    theirs_blocks = max(_relative_error(r["torch"], reference_full, True) for r in exact)
    theirs_all = max(_relative_error(r["torch"], reference_full, False) for r in exact)
    gpt = {"n_layer": 4, "n_head": 4, "n_embd": 64 if args.quick else 128, "block_size": 64}
    memory_config = {"gpt": gpt, "m": 8, "rows": 4, "rounds": 3 if args.quick else 5}
    memory = launch(memory_rank, memory_config, world_size=2, timeout_s=600.0)
    predicted = predict_memory(memory_config)
    report = {
        "exact": {"ours": ours, "torch_blocks": theirs_blocks, "torch_all": theirs_all},
        "memory": memory,
        "memory_config": memory_config,
        "predicted": predicted,
    }
    markdown = _markdown(report, m)
    command = results.reproducing_command(
        "pipeline", sys.argv[1:] if argv is None else argv, json_mode=args.json
    )
    markdown += f"\n\nReproduce: `{command}`"
    return results.emit(SECTION, markdown, report, json_mode=args.json, write=not args.no_write)


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


def _memory_row(rank_index: int, rank_result: dict[str, Any], predicted: dict[str, Any]) -> list[Any]:
    peaks, seconds = rank_result["peaks"], rank_result["seconds"]
    row: list[Any] = [f"stage {rank_index}"]
    for name in ("gpipe", "1f1b"):
        guess = predicted[name]["peak_bytes"][rank_index]
        error = 100 * (guess - peaks[name]) / peaks[name]
        row += [predicted[name]["in_flight"][rank_index], format_bytes(peaks[name])]
        row += [f"{format_bytes(guess)} ({error:+.1f} %)"]
    row += [f"{peaks['gpipe'] / peaks['1f1b']:.2f}x", f"{seconds['gpipe']:.3f}", f"{seconds['1f1b']:.3f}"]
    return row


def _markdown(report: dict[str, Any], m: int) -> str:
    memory, config, predicted = report["memory"], report["memory_config"], report["predicted"]
    gpt = config["gpt"]
    lines = _exactness_lines(report["exact"], m)
    lines += [
        f"Memory: float32, {gpt['n_layer']} layers, width {gpt['n_embd']}, block {gpt['block_size']}, "
        f"m = {config['m']} micro-batches of {config['rows']} sequences per step. Measured: each rank's peak "
        "live tensor bytes over one window's forward and backward (MemoryTracker); seconds the fastest timed "
        "window (wall clock), schedules alternating. Predicted: microbatch.planner.pipeline (each stage's "
        "micro-batch alone on one process; k micro-batches in flight, GPipe m, 1F1B min(m, S - s)).",
        "",
    ]
    headers = ["rank", "GPipe k", "GPipe measured", "GPipe predicted", "1F1B k", "1F1B measured"]
    headers += ["1F1B predicted", "GPipe / 1F1B", "GPipe s/window", "1F1B s/window"]
    table = [_memory_row(r, result, predicted) for r, result in enumerate(memory)]
    lines.append(results.markdown_table(headers, table))
    one = predicted["1f1b"]
    ratios = {
        name: max(r["seconds"][name] for r in memory) / predicted[name]["seconds_per_step"]
        for name in ("gpipe", "1f1b")
    }
    lines += [
        "",
        f"Predicted s/window: {one['seconds_per_step']:.3f} ((m + S - 1) x the slowest stage's forward + "
        f"backward on one thread's CPU clock; bubble {one['bubble_fraction']:.0%}); the slower rank's "
        f"measured wall-clock window is {ratios['1f1b']:.2f}x that under 1F1B and {ratios['gpipe']:.2f}x "
        "under GPipe "
        "(point-to-point transfers and the shared machine are not in the model). 1F1B's peaks are "
        "under-predicted by a few percent: after its first backward it keeps some bytes the model does not "
        "count yet; GPipe's match.",
        "",
        results.environment_line() + " Measured while other jobs shared the machine (2 cores).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
