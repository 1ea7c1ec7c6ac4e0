"""Shared by the benchmark scripts: the environment a number was measured on, and RESULTS.md sections.

``environment_line()`` says where and when: machine, CPU count, torch version, date. Every table
row in RESULTS.md carries it. ``write_section(title, markdown)`` replaces the ``## title`` section of
benchmarks/RESULTS.md (or appends it), leaving the other sections as they are, so each suite owns
its own section and the file is only ever written by the scripts, never by hand.

Import it from a script next to this file (``python benchmarks/x.py`` puts benchmarks/ on sys.path):

    import results
    results.write_section("Peers", body)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = (
    "# Benchmark results\n\n"
    "Written by `microbatch bench` (each suite's script, `benchmarks/<suite>.py`); not edited by hand.\n"
    "Every row names the machine, the torch version and the date it was measured on.\n"
)
_HEADING = re.compile(r"^## (.+?)\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def environment() -> dict[str, Any]:
    """Machine, accelerator, CPU count, torch and Python versions, and today's date (UTC)."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "arch": platform.machine(),
        "cpu_count": cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def environment_line(info: dict[str, Any] | None = None) -> str:
    """One line: 'Intel Xeon ... (x86_64), 2 CPUs, torch 2.13.0+cpu, 2025-11-29' (plus the GPU)."""
    info = info or environment()
    device = f"{info['gpu']}, " if info.get("gpu") else ""
    return (
        f"{device}{info['cpu']} ({info['arch']}), {info['cpu_count']} CPUs, "
        f"torch {info['torch']}, {info['date']}"
    )


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are str()-ed and '|' inside them escaped."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _split_sections(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The lines before the first '## ' heading, and (title, lines) per section; fences respected."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        match = None if in_fence else _HEADING.match(line)
        if match:
            sections.append((match.group(1), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return preamble, sections


def write_section(title: str, markdown: str, *, path: str | os.PathLike[str] | None = None) -> Path:
    """Replace the '## title' section of RESULTS.md with ``markdown`` (append it when absent)."""
    title = title.strip()
    if not title or "\n" in title:
        raise ValueError(f"title must be one non-empty line, got {title!r}")
    target = Path(path) if path is not None else RESULTS_PATH
    text = target.read_text(encoding="utf-8") if target.exists() else HEADER
    preamble, sections = _split_sections(text)
    body = [f"## {title}", "", *markdown.strip("\n").splitlines(), ""]
    for index, (existing, _) in enumerate(sections):
        if existing == title:
            sections[index] = (title, body)
            break
    else:
        sections.append((title, body))
    while preamble and not preamble[-1].strip():
        preamble.pop()
    out: list[str] = [*preamble, ""]
    for _, lines in sections:
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        out += [*lines, ""]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(out), encoding="utf-8")
    return target


def reproducing_command(suite: str, argv: Sequence[str], *, json_mode: bool) -> str:
    """The command that remakes a suite's section: ``microbatch bench`` when it ran it, else python."""
    rest = [arg for arg in argv if arg != "--json"]
    if json_mode and set(rest) <= {"--quick"}:
        return "microbatch bench" + (" --quick" if rest else "") + f" {suite}"
    return " ".join(["python", f"benchmarks/{suite}.py", *rest])


def emit(title: str, markdown: str, report: dict[str, Any], *, json_mode: bool, write: bool) -> int:
    """A suite's last word. With --json: one JSON object on stdout (``microbatch bench`` reads its
    ``markdown`` and writes the section). Otherwise the section is written (unless ``write`` is False)
    and printed."""
    if json_mode:
        print(json.dumps({"title": title, "markdown": markdown, **report}, indent=2, default=str))
        return 0
    if write:
        write_section(title, markdown)
    print(markdown)
    return 0


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--json (what ``microbatch bench`` reads; RESULTS.md untouched) and --no-write, shared by the suites."""
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON with the section's markdown (what microbatch bench reads); do not write RESULTS.md",
    )
    parser.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
