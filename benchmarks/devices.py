"""Plans for devices that are not here: named architectures planned for GPU presets on this CPU.

For each model and device: the simulated plan (fake tensors, roofline time), its predicted peak and
seconds per optimizer step, beside what ``accelerate estimate-memory`` says for the model (training
with Adam, no activations) and Korthikanti et al.'s activation formula sbh(34 + 5as/h) per layer,
times the layers, at the plan's micro-batch (16-bit, no flash attention: an upper bound for models
that use SDPA; it knows no SwiGLU, GQA or vocabulary-sized logits). Each row names the command
that reproduces it.

    python benchmarks/devices.py              # 3 models x 3 devices, writes RESULTS.md
    python benchmarks/devices.py --quick --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from typing import Any

import results
from microbatch.errors import InfeasibleBudgetError
from microbatch.hf.configs import ModelSetup, simulate_config_profile
from microbatch.memory import format_bytes
from microbatch.memory.device_specs import devices
from microbatch.planner import plan
from microbatch.planner.result.plans import summarize_policies
from microbatch.planner.target.per_rank import accelerate_estimate, korthikanti_bytes

SECTION_TITLE = "Plans for devices that are not here"
MODELS = ("gpt2-medium", "llama-3.2-1b", "llama-3.1-8b")
DEVICES = ("h100-80gb", "a100-40gb", "rtx4090")


def plan_row(model: str, device: str, *, batch: int, seq_len: int, precision: str) -> dict[str, Any]:
    """One simulated plan (or the minimum it needs) with the estimates beside it."""
    spec = devices()[device]
    memory = f"{spec.memory_bytes // 1024**3}GiB"
    command = (
        f"microbatch plan {model} --device {device} --batch {batch} --seq-len {seq_len} "
        f"--precision {precision} --memory {memory}"
    )
    began = time.perf_counter()
    setup = ModelSetup(seq_len=seq_len, precision=precision)
    workload, profile = simulate_config_profile(model, setup, spec, max_micro_batch_size=min(batch, 16))
    row: dict[str, Any] = {"model": model, "device": device, "memory": memory, "command": command}
    row["accelerate_bytes"] = accelerate_estimate(workload.model, precision)
    try:
        chosen = plan(workload, batch=batch, memory=memory, profile=profile, device=spec)
    except InfeasibleBudgetError:
        # The least any plan needs: the search's minimum with no budget in the way (the error's own
        # minimum is only parameters + gradients when the planner refuses before searching).
        # A budget above a preset's memory is refused, so the search runs on a copy with 1 TiB.
        roomy = spec.replace(memory_bytes=2**40)
        needed = plan(workload, batch=batch, memory="1TiB", profile=profile, device=roomy).minimum_bytes
        row.update(plan=f"none fits: needs {format_bytes(needed)}", peak_bytes=needed)
        row.update(seconds_per_step=None, formula_bytes=None, micro_batch_size=None)
    else:
        row.update(
            plan=f"{chosen.micro_batch_size} x {chosen.steps}, {summarize_policies(chosen.block_policies)}",
            peak_bytes=chosen.predicted_peak_bytes,
            seconds_per_step=chosen.predicted_seconds_per_step,
            micro_batch_size=chosen.micro_batch_size,
            formula_bytes=korthikanti_bytes(
                workload.model, seq_len=seq_len, micro_batch_size=chosen.micro_batch_size
            ),
            activation_bytes=dict(chosen.estimates).get("microbatch: layer activations, no checkpointing"),
        )
    row["static_bytes"] = profile.static_bytes
    row["planning_seconds"] = time.perf_counter() - began
    return row


def _size(value: Any) -> str:
    return format_bytes(value) if isinstance(value, (int, float)) else "-"


def section(report: dict[str, Any]) -> str:
    rows = [
        [
            row["model"],
            row["device"],
            row["plan"],
            _size(row["peak_bytes"]),
            f"{row['seconds_per_step']:.3g}" if row["seconds_per_step"] is not None else "-",
            _size(row["static_bytes"]),
            _size(row.get("activation_bytes")),
            _size(row["accelerate_bytes"]),
            _size(row["formula_bytes"]),
            f"{row['planning_seconds']:.0f}",
            f"`{row['command']}`",
        ]
        for row in report["rows"]
    ]
    headers = [
        "model",
        "device",
        "plan (micro x steps, policies)",
        "predicted peak",
        "s/step",
        "params+grads+Adam",
        "activations, none checkpointed",
        "accelerate (Adam)",
        "Korthikanti, all layers",
        "plan s",
        "command",
    ]
    return "\n".join(
        [
            f"Batch {report['batch']} sequences of {report['seq_len']} tokens, "
            f"{report['precision']} parameters, AdamW, one rank, the budget the device's memory. "
            "Simulated on this CPU under fake tensors: "
            "peak from MemoryTracker's categories with the CUDA allocator's rounding and a 512 MiB context "
            "allowance; time from a roofline on achieved rates per op class (memory/device_specs.py "
            "cites them). "
            "accelerate counts model states only; Korthikanti's formula (16-bit, no flash attention) is per "
            "layer times the layers at the plan's micro-batch, and misses the logits, SwiGLU's wider MLP and "
            "GQA, while over-counting attention that SDPA does not keep. "
            "Policies searched: none, full and selective. "
            f"Peak RSS of the whole run: {report['max_rss_mib']:.0f} MiB; measured on a machine shared with "
            "other jobs (planning seconds are wall-clock under that load).",
            "",
            results.markdown_table(headers, rows),
            "",
            results.environment_line(),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--quick", action="store_true", help="one model on one device")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    models, targets = (MODELS[:1], DEVICES[-1:]) if args.quick else (MODELS, DEVICES)
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        rows = [
            plan_row(model, device, batch=args.batch, seq_len=args.seq_len, precision=args.precision)
            for model in models
            for device in targets
        ]
    report: dict[str, Any] = {
        "rows": rows,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "precision": args.precision,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "command": results.reproducing_command(
            "devices", sys.argv[1:] if argv is None else list(argv), json_mode=args.json
        ),
    }
    return results.emit(SECTION_TITLE, section(report), report, json_mode=args.json, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
