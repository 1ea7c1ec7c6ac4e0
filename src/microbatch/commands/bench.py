"""``microbatch bench [suite ...] [--quick] [--json]``: run the benchmark suites, write RESULTS.md.

A suite is a script ``benchmarks/<suite>.py`` in a source checkout. Each accepts ``--quick`` and
``--json``; with ``--json`` it prints one JSON object on stdout:

    {"title": "Peers",              its section heading in RESULTS.md (default: the suite's name)
     "markdown": "...",             the section's body: tables whose rows name machine, torch, date
     "plots": [{"name": ..., "kind": "bar" | "barh", "title": ..., "ylabel": ..., "log": false,
                "labels": [...], "series": {"name": [value or null, ...]},
                "reference": {"value": 1.0, "label": "..."}}],   (optional: a line across the bars)
     ...}                           anything else; ``bench --json`` passes it all through

The command runs each script as ``python benchmarks/<suite>.py --json [--quick]`` from the
checkout's root (its src/ first on PYTHONPATH), replaces the suite's ``## title`` section of
benchmarks/RESULTS.md with the markdown (through benchmarks/results.py), draws the plots into
benchmarks/plots/ and links them under the section. A suite that fails, or whose JSON carries no
markdown, leaves the file as it was. ``--quick`` is a smoke run: it writes RESULTS-quick.md (and
``-quick`` plots), so the full run's numbers are never overwritten by small sizes.

The scripts are not installed with the package: from an installed wheel there is nothing to run,
and the command says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError

logger = logging.getLogger(__name__)

# Suites run in this order when none are named; any other script in benchmarks/ runs after them.
PREFERRED_ORDER = ("peers", "accumulate_overhead", "checkpoint_overhead", "planner", "distributed")
# Scripts in benchmarks/ that are helpers, not suites.
NOT_SUITES = frozenset({"results", "conftest"})
DEFAULT_TIMEOUT_SECONDS = 3600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help="suites to run (scripts benchmarks/SUITE.py, e.g. peers, accumulate-overhead); default: all",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every suite")
    parser.add_argument("--json", action="store_true", help="print every suite's JSON instead of a summary")
    parser.add_argument(
        "--root", metavar="DIR", help="the source checkout holding benchmarks/ (default: found automatically)"
    )
    parser.add_argument(
        "--output",
        metavar="FILE",
        help="the results file to write (default: benchmarks/RESULTS.md; plots go next to it, in plots/)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"stop a suite that runs longer (default {DEFAULT_TIMEOUT_SECONDS:.0f})",
    )


# ------------------------------------------------------------------------------------------------
# Finding the checkout and its suites


def _suite_scripts(benchmarks: Path) -> list[Path]:
    """Suites: scripts benchmarks/NAME.py, and packages benchmarks/NAME/ with a __main__.py."""
    scripts = [*benchmarks.glob("*.py"), *(path.parent for path in benchmarks.glob("*/__main__.py"))]
    return sorted(
        (
            path
            for path in scripts
            if path.stem not in NOT_SUITES and not path.stem.startswith(("_", "test_"))
        ),
        key=lambda path: path.stem,
    )


def _suite_path(root: Path, suite: str) -> Path:
    """What python runs for ``suite``: its script, or its package folder (python runs __main__.py)."""
    package = root / "benchmarks" / suite
    return package if (package / "__main__.py").is_file() else root / "benchmarks" / f"{suite}.py"


def find_root(explicit: str | os.PathLike[str] | None = None, *, cwd: Path | None = None) -> Path:
    """The source checkout whose benchmarks/ holds the suites.

    ``explicit`` (--root) if given; else the checkout this package was installed from (editable
    install: src/microbatch/commands/ sits three levels under it), else the working directory or
    one of its parents.
    """
    if explicit is not None:
        candidates = [Path(explicit)]
    else:
        here = Path(__file__).resolve()
        start = (cwd or Path.cwd()).resolve()
        candidates = [here.parents[3], start, *start.parents]
    for root in candidates:
        if (root / "benchmarks").is_dir() and _suite_scripts(root / "benchmarks"):
            return root.resolve()
    looked = ", ".join(str(c) for c in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
    where = (
        f"--root {explicit}"
        if explicit is not None
        else f"the package's checkout or the working directory ({looked})"
    )
    raise ConfigError(
        f"microbatch bench runs the scripts in benchmarks/ of a source checkout, and {where} has no "
        "benchmarks/*.py. They are not part of an installed wheel: clone the repository, run "
        "`pip install -e '.[bench]'` in it, and run `microbatch bench` there (or pass --root DIR)"
    )


def resolve_suites(root: Path, names: Sequence[str]) -> list[str]:
    """Suite names to run, in order; unknown names raise ConfigError listing the known ones."""
    available = [path.stem for path in _suite_scripts(root / "benchmarks")]
    ordered = [s for s in PREFERRED_ORDER if s in available] + [
        s for s in available if s not in PREFERRED_ORDER
    ]
    if not names:
        return ordered
    chosen: list[str] = []
    for name in names:
        suite = name.replace("-", "_").removesuffix(".py")
        if suite not in available:
            raise ConfigError(
                f"unknown suite {name!r}: benchmarks/ in {root} has {', '.join(ordered)}; "
                "name one of those (or none, to run them all)"
            )
        if suite not in chosen:
            chosen.append(suite)
    return chosen


def _load_results_module(root: Path) -> ModuleType:
    path = root / "benchmarks" / "results.py"
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: it is the benchmarks' helper that writes RESULTS.md; "
            "restore it from the repository"
        )
    spec = importlib.util.spec_from_file_location("microbatch_bench_results", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------
# Running a suite


def _parse_json(stdout: str) -> dict[str, Any] | None:
    """The suite's JSON object: all of stdout, or else its last line that is one."""
    text = stdout.strip()
    candidates = [text, *reversed(text.splitlines())]
    for candidate in candidates:
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def run_suite(
    root: Path, suite: str, *, quick: bool, timeout_seconds: float, verbose: bool = False
) -> dict[str, Any]:
    """Run one suite's script; its JSON object, or {"error": ...} when it failed."""
    command = [
        sys.executable,
        str(_suite_path(root, suite).relative_to(root)),
        "--json",
        *(["--quick"] if quick else []),
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root / "src"), env.get("PYTHONPATH", "")) if p)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=None if verbose else subprocess.PIPE,
            text=True,
            timeout=timeout_seconds,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_seconds:.0f} s", "command": " ".join(command)}
    seconds = time.perf_counter() - began
    report = _parse_json(done.stdout) if done.returncode == 0 else None
    if report is None:
        tail = (done.stderr or "").strip().splitlines()[-15:]
        why = f"exit status {done.returncode}" if done.returncode else "no JSON object on stdout"
        return {"error": why, "stderr_tail": tail, "command": " ".join(command), "seconds": seconds}
    report.setdefault("seconds", seconds)
    report["_command"] = " ".join(["python", *command[1:]])
    return report


# ------------------------------------------------------------------------------------------------
# Writing


def draw_plot(spec: dict[str, Any], directory: Path, *, suffix: str = "") -> Path:
    """A grouped bar chart from a suite's plot spec (see the module docstring), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(label).replace("`", "") for label in spec["labels"]]
    series: dict[str, list[Any]] = spec["series"]
    horizontal = spec.get("kind") == "barh"
    width = 0.8 / max(1, len(series))
    figure, axes = plt.subplots(figsize=(10, max(3.0, 0.45 * len(labels) + 1.5)) if horizontal else (9, 4.5))
    for index, (name, values) in enumerate(series.items()):
        positions = [i + (index - (len(series) - 1) / 2) * width for i in range(len(labels))]
        heights = [float(v) if isinstance(v, (int, float)) and math.isfinite(v) else math.nan for v in values]
        if spec.get("log"):
            heights = [max(h, 1e-17) if not math.isnan(h) else h for h in heights]
        bar = axes.barh if horizontal else axes.bar
        bar(positions, heights, width, label=name if len(series) > 1 else None)
    ticks = range(len(labels))
    if horizontal:
        axes.set_yticks(list(ticks), labels)
        axes.set_xlabel(spec.get("ylabel", ""))
        axes.invert_yaxis()
        if spec.get("log"):
            axes.set_xscale("log")
    else:
        axes.set_xticks(list(ticks), labels)
        axes.set_ylabel(spec.get("ylabel", ""))
        if spec.get("log"):
            axes.set_yscale("log")
    reference = spec.get("reference")
    if reference:
        line = axes.axvline if horizontal else axes.axhline
        line(
            float(reference["value"]),
            color="black",
            linestyle="--",
            linewidth=1,
            label=reference.get("label"),
        )
    axes.set_title(textwrap.fill(str(spec.get("title", "")), 70), fontsize="medium")
    if len(series) > 1 or reference:
        axes.legend(fontsize="small")
    figure.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{spec['name']}{suffix}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def section_of(suite: str, report: dict[str, Any]) -> tuple[str, str] | None:
    """The suite's RESULTS.md section (title, body), or None when its JSON carries no markdown."""
    body = report.get("markdown")
    if not isinstance(body, str) or not body.strip():
        return None
    return str(report.get("title") or suite.replace("_", " ").capitalize()), body


def _check_output(output: Path) -> None:
    """ConfigError naming --output unless its folder exists and the file can be written there."""
    folder = output.parent if str(output.parent) else Path(".")
    writable = folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    if not writable or output.is_dir() or (output.exists() and not os.access(output, os.W_OK)):
        raise ConfigError(
            f"--output {str(output)!r}: cannot write the results there (its folder does not exist, is not "
            "writable, or it is a folder); choose a file in a folder you can write to"
        )


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ConfigError(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
    root = find_root(args.root)
    suites = resolve_suites(root, args.suites)
    results = _load_results_module(root)
    # A quick run is a smoke test: it must not overwrite the full run's numbers.
    default_name = "RESULTS-quick.md" if args.quick else "RESULTS.md"
    output = Path(args.output) if args.output else root / "benchmarks" / default_name
    _check_output(output)  # before the suites run (they may take many minutes)
    plot_dir = output.parent / "plots"
    plot_suffix = "-quick" if args.quick else ""
    verbose = bool(getattr(args, "verbose", False))
    collected: dict[str, dict[str, Any]] = {}
    for suite in suites:
        print(f"bench: {suite}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        report = run_suite(root, suite, quick=args.quick, timeout_seconds=args.timeout, verbose=verbose)
        collected[suite] = report
        if "error" in report:
            tail = "\n  ".join(report.get("stderr_tail", []))
            print(
                f"bench: {suite}: FAILED ({report['error']}): {report.get('command')}\n  {tail}",
                file=sys.stderr,
            )
            continue
        section = section_of(suite, report)
        if section is None:
            print(f"bench: {suite}: its JSON has no 'markdown'; no section written", file=sys.stderr)
            continue
        title, body = section
        links = []
        for spec in report.get("plots") or []:
            try:
                path = draw_plot(spec, plot_dir, suffix=plot_suffix)
            except (KeyError, TypeError, ValueError) as error:
                logger.warning("suite %s: plot %r not drawn: %s", suite, spec.get("name"), error)
                continue
            link = path.relative_to(output.parent).as_posix()
            links.append(f"![{spec.get('title', spec['name'])}]({link})")
        if links:
            body = body.rstrip("\n") + "\n\n" + "\n".join(links) + "\n"
        results.write_section(title, body, path=output)
        seconds = report.get("seconds", 0)
        print(
            f"bench: {suite}: {seconds:.0f} s; wrote section '{title}' of {output}",
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        payload = {"root": str(root), "output": str(output), "quick": args.quick, "suites": collected}
        print(json.dumps(payload, indent=1, default=str))
    else:
        for suite, report in collected.items():
            state = f"FAILED ({report['error']})" if "error" in report else "ok"
            print(f"{suite:<24} {state}")
        print(f"results: {output}")
    return 1 if any("error" in report for report in collected.values()) else 0
