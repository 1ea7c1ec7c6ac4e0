"""What a run reports: a StepReport after every optimizer step, a TrainSummary at the end.

The summary describes the whole run, across resumes: it is computed from metrics.jsonl (one line
per optimizer step since step 1, kept across resumes), not from the last segment's counters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..memory import format_bytes


@dataclass(frozen=True)
class StepReport:
    """What the progress display gets after every optimizer step.

    ``val_loss`` is set only on the steps that computed one. ``peak_bytes`` is the peak of step
    ``peak_step`` (on CPU the tracker measures some steps only; the others repeat the latest), made
    of the micro-batches ``peak_what`` names: training's own, which by tokens
    (``micro-batches of <= N tokens``) are often smaller than the plan's trial window, whose rows are
    all full length.
    """

    step: int
    total_steps: int
    loss: float
    lr: float
    tokens_per_second: float
    peak_bytes: int
    eta_seconds: float
    val_loss: float | None
    peak_step: int | None = None
    peak_what: str = ""


@dataclass(frozen=True)
class TrainSummary:
    """The outcome of a run, all segments together (also written to summary.json).

    ``tokens`` and ``seconds`` sum every optimizer step since step 1; ``stopped_by`` names the
    signal (SIGINT, SIGTERM) that interrupted it, None when it ran to the end. The whole run's
    memory evidence (memory/window_peaks.py): ``worst_window_peak_bytes`` is the highest window peak, at
    step ``worst_window_step``, measured (``worst_window_measured``; ``windows_measured`` were) or
    bounded by a measured window that covers it, against the plan's ``budget_bytes`` (None for a
    manual plan), ``windows_over_budget`` of them above it.
    """

    run_dir: str
    model: str
    steps_done: int
    total_steps: int
    first_loss: float | None
    final_loss: float | None
    val_loss: float | None
    tokens: int
    seconds: float
    tokens_per_second: float
    peak_bytes: int
    peak_bytes_source: str
    parameters: int
    device: str
    plan: dict[str, Any]
    resumed_from_step: int | None
    interrupted: bool
    checkpoint: str
    stopped_by: str | None = None
    replans: int = 0
    budget_bytes: int | None = None
    worst_window_peak_bytes: int | None = None
    worst_window_step: int | None = None
    worst_window_measured: bool | None = None
    windows_measured: int = 0
    windows_over_budget: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        val = f", validation loss {self.val_loss:.4f}" if self.val_loss is not None else ""
        loss = (
            f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}"
            if self.final_loss is not None
            else "no steps"
        )
        state = "interrupted" if self.interrupted else "finished"
        worst = ""
        if self.worst_window_peak_bytes is not None and self.budget_bytes is not None:
            worst = (
                f", worst window {format_bytes(self.worst_window_peak_bytes)} "
                f"(step {self.worst_window_step}) of the budget {format_bytes(self.budget_bytes)}"
            )
        return (
            f"{state} {self.steps_done}/{self.total_steps} steps of {self.model} on {self.device}: "
            f"{loss}{val}; "
            f"{self.tokens:,} tokens in {self.seconds:.1f} s ({self.tokens_per_second:,.0f} tokens/s), "
            f"peak {format_bytes(self.peak_bytes)} ({self.peak_bytes_source}){worst}; "
            f"run folder {self.run_dir}"
        )


def whole_run_totals(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Losses, tokens, seconds and peak of every step in ``metrics`` (the whole run so far)."""
    losses = [record["loss"] for record in metrics]
    val_losses = [record["val_loss"] for record in metrics if record.get("val_loss") is not None]
    tokens = sum(int(record.get("items", 0)) for record in metrics)
    seconds = sum(float(record.get("seconds", 0.0)) for record in metrics)
    return {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "val_loss": val_losses[-1] if val_losses else None,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "peak_bytes": max((int(record["peak_bytes"]) for record in metrics), default=0),
    }
