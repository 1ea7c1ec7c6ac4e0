"""Faults of issue 22: run folders, one writer, saved state, session signals, temporaries, huge sizes.

Imported by faults.py (``python benchmarks/faults.py --only runs``); each case runs real processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faults  # benchmarks/faults.py: Case, Ran, cli, python, judged, train, TINY
from faults import TINY, Case, Ran, cli, judged, python, snippet_outcome, train

OWNER = "runs"


def _refused(ran: Ran, *fragments: str) -> tuple[str, str]:
    """clear error when refused with status 2 and every fragment in the last line; else what it was."""
    outcome, detail = judged(ran, ok=lambda r: False)
    last_line = (ran.err.strip().splitlines() or [""])[-1]  # the whole line (detail is cut at 160)
    if outcome == "clear error" and not all(fragment in last_line for fragment in fragments):
        return "traceback", f"misleading (wants {fragments}): {detail}"
    if outcome == "clear error" and "error in your code" in ran.err:
        return "traceback", "blames the user's code: " + detail
    return outcome, detail


def _snapshot(folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def _popen_train(out: str, *extra: str, cwd: str | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "microbatch", "train", *TINY, *extra, *(["--out", out] if out else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=faults.environment(),
        cwd=cwd or str(faults.ROOT),
        start_new_session=True,
    )


def _wait_for(predicate: Callable[[], bool], process: subprocess.Popen[str], seconds: float = 120) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and process.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _lines(out: str) -> int:
    with_lines = Path(out, "metrics.jsonl")
    return len(with_lines.read_text().splitlines()) if with_lines.is_file() else 0


# ----------------------------------------------------------------------------------------- folders
def folder_cases(work: str) -> list[Case]:
    cases: list[Case] = []

    def add(name: str, expected: str, result: tuple[str, str], ran: Ran) -> None:
        cases.append(Case(name, expected, result[0], result[1], ran.seconds, OWNER))

    users = os.path.join(work, "users")
    os.makedirs(users)
    for name in ("config.json", "metrics.jsonl", "summary.json", "loss.png", ".draft.tmp"):
        Path(users, name).write_text(f"the user's own {name}\n")
    before = _snapshot(users)
    ran = train(users, "--steps", "1")
    result = _refused(ran, "'.draft.tmp'", "--resume")
    add("--out DIR holding the user's files", "refused naming the first, files untouched",
        result if _snapshot(users) == before else ("data lost", "the user's files changed"), ran)  # fmt: skip
    project = os.path.join(work, "project")
    os.makedirs(project)
    Path(project, "train.py").write_text("print('mine')\n")
    ran = cli("train", *TINY, "--steps", "1", "--out", ".", cwd=project)
    add("--out . in a project folder", "refused naming train.py", _refused(ran, "'train.py'"), ran)
    copied = os.path.join(work, "copied")
    train(os.path.join(work, "source"), "--steps", "1")
    os.makedirs(copied)
    Path(copied, "checkpoint.pt").write_bytes(Path(work, "source", "checkpoint.pt").read_bytes())
    Path(copied, "notes.txt").write_text("mine\n")
    ran = train(copied, "--resume", "--steps", "2")
    add("--resume into a folder with a copied checkpoint", "refused: not a run folder",
        _refused(ran, "not a microbatch run folder"), ran)  # fmt: skip
    Path(work, "source", ".microbatch-run.json").write_text('{"format": "something-else"}')
    ran = train(os.path.join(work, "source"), "--resume", "--steps", "2")
    add("run marker tampered", "refused naming the marker", _refused(ran, ".microbatch-run.json"), ran)
    cases += writer_cases(work)
    return cases


def writer_cases(work: str) -> list[Case]:
    cases: list[Case] = []
    out = os.path.join(work, "busy")
    first = _popen_train(out, "--steps", "100000", "--checkpoint-interval", "2")
    _wait_for(lambda: Path(out, "checkpoint.pt").is_file(), first)
    second = train(out, "--steps", "3")
    resumer = train(out, "--resume", "--steps", "3")
    for name, ran in (("two trains into one --out", second), ("--resume while the run goes", resumer)):
        result = _refused(ran, f"PID {first.pid}")
        cases.append(Case(name, "second refused at once with the holder's PID", *result, ran.seconds, OWNER))
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    ran = train(out, "--resume", "--steps", _next_steps(out))
    result = judged(ran, ok=lambda r: r.rc == 0)
    cases.append(
        Case("resume after kill -9 of the holder", "no stale lock: resumes", *result, ran.seconds, OWNER)
    )
    cases.append(_same_second_case(work))
    return cases


def _next_steps(out: str) -> str:
    return str(_lines(out) + 2)


def _same_second_case(work: str) -> Case:
    """Two runs without --out started together: two folders, each with its own steps."""
    cwd = os.path.join(work, "defaults")
    os.makedirs(cwd)
    began = time.perf_counter()
    processes = [_popen_train("", "--steps", "2", cwd=cwd) for _ in range(2)]
    for process in processes:
        process.communicate(timeout=300)
    folders = sorted(Path(cwd, "runs").iterdir()) if Path(cwd, "runs").is_dir() else []
    steps = [_lines(str(folder)) for folder in folders]
    ok = len(folders) == 2 and steps == [2, 2] and all(p.returncode == 0 for p in processes)
    detail = f"{[folder.name for folder in folders]}, lines {steps}"
    return Case("two default-named runs at once", "two folders, 2 lines each", "ok" if ok else "data lost",
                detail, time.perf_counter() - began, OWNER)  # fmt: skip


# ----------------------------------------------------------------------------------------- signals, links
def signal_cases(work: str) -> list[Case]:
    cases = []
    for sig in (signal.SIGHUP, signal.SIGUSR1):
        out = os.path.join(work, f"signal-{sig.name}")
        process = _popen_train(out, "--steps", "100000", "--checkpoint-interval", "100000")
        began = time.perf_counter()
        _wait_for(lambda out=out: _lines(out) >= 2, process)  # type: ignore[misc]
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
        saved = Path(out, "checkpoint.pt").is_file() and Path(out, "summary.json").is_file()
        resumed = train(out, "--resume", "--steps", _next_steps(out))
        ok = process.returncode == 128 + sig and saved and resumed.rc == 0 and faults.TRACEBACK not in err
        outcome = "ok" if ok else ("traceback" if faults.TRACEBACK in err else "data lost")
        detail = f"exit {process.returncode}, saved {saved}, resume exit {resumed.rc}"
        cases.append(Case(f"{sig.name} mid-run", f"saved, exit {128 + sig}, resumable", outcome, detail,
                          time.perf_counter() - began, OWNER))  # fmt: skip
    cases.append(_symlink_case(work))
    return cases


def _symlink_case(work: str) -> Case:
    out, victim = os.path.join(work, "linked"), Path(work, "victim.txt")
    victim.write_text("precious\n")
    process = _popen_train(out, "--steps", "100000", "--checkpoint-interval", "100000")
    began = time.perf_counter()
    _wait_for(lambda: _lines(out) >= 2, process)
    metrics = Path(out, "metrics.jsonl")
    os.replace(_make_link(victim, Path(out, "link.tmp")), metrics)
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return Case("metrics.jsonl replaced by a symlink", "refused", "hang", "", 120, OWNER)
    written = victim.read_text() != "precious\n"
    last = (err.strip().splitlines() or [""])[-1][:160]
    outcome = (
        "data lost"
        if written
        else ("clear error" if process.returncode == 2 and "symbolic link" in last else "traceback")
    )
    return Case("metrics.jsonl replaced by a symlink mid-run", "never written through; clear error", outcome,
                last, time.perf_counter() - began, OWNER)  # fmt: skip


def _make_link(target: Path, link: Path) -> Path:
    link.symlink_to(target)
    return link


# ----------------------------------------------------------------------------------------- saved state
def _plan_cases(work: str) -> list[Case]:
    cases: list[Case] = []
    base = os.path.join(work, "planbase")
    train(base, "--steps", "1")
    good: dict[str, Any] = json.loads(Path(base, "plan.json").read_text())
    edits: dict[str, dict[str, Any]] = {
        "sizes sum past the batch": {"micro_batch_sizes": [3, 3, 3]},
        "micro_batch_size disagrees": {"micro_batch_size": 2},
        "fractional sizes": {"micro_batch_sizes": [4.7, 3.3], "steps": 2},
        "negative budget": {"budget_bytes": -1},
        "NaN budget": {"budget_bytes": math.nan},
        "string where a number belongs": {"batch_size": "eight"},
        "steps 10^9": {"steps": 10**9},
        "unknown policy": {"policies": {"blocks.0": "half"}},
        "batch size 0": {"batch_size": 0},
    }
    for name, change in edits.items():
        path = Path(work, f"plan-{len(cases)}.json")
        path.write_text(json.dumps({**good, **change}))
        ran = train(
            os.path.join(work, f"planrun-{len(cases)}"), "--plan", str(path), "--steps", "1", flags=TINY[:4]
        )
        cases.append(Case(f"--plan edited: {name}", "refused naming the file and field",
                          *_refused(ran, str(path), "field"), ran.seconds, OWNER))  # fmt: skip
    fifo = Path(work, "fifo.json")
    os.mkfifo(fifo)
    huge = Path(work, "huge.json")
    huge.write_text('{"frontier": [' + ",".join(['{"micro_batch_size": 1}'] * 800_000) + "]}")
    nested = Path(work, "nested.json")
    nested.write_text("[" * 100_000 + "]" * 100_000)
    cut = Path(work, "cut.json")
    cut.write_text(Path(base, "plan.json").read_text()[:200])
    for name, path in (
        ("a FIFO", fifo),
        ("an 18 MB file", huge),
        ("nested JSON", nested),
        ("cut short", cut),
    ):
        ran = train(os.path.join(work, f"planrun-{len(cases)}"), "--plan", str(path), "--steps", "1",
                    flags=TINY[:4], timeout=60)  # fmt: skip
        cases.append(Case(f"--plan {name}", "refused at once", *_refused(ran, str(path)), ran.seconds, OWNER))
    return cases


def history_cases(work: str) -> list[Case]:
    cases = _plan_cases(work)
    edits: dict[str, Callable[[list[str]], list[str]]] = {
        "a line deleted": lambda lines: lines[:1] + lines[2:],
        "a step duplicated": lambda lines: lines[:2] + lines[1:],
        "emptied": lambda lines: [],
        "stops at step 2 (checkpoint at 4)": lambda lines: lines[:2],
        'step "abc"': lambda lines: [lines[0].replace('"step": 1', '"step": "abc"'), *lines[1:]],
        "step null": lambda lines: [lines[0].replace('"step": 1', '"step": null'), *lines[1:]],
        "a field missing": lambda lines: [lines[0].replace('"loss"', '"lost"'), *lines[1:]],
    }
    for index, (name, edit) in enumerate(edits.items()):
        out = os.path.join(work, f"history-{index}")
        train(out, "--steps", "4", "--checkpoint-interval", "1")
        lines = Path(out, "metrics.jsonl").read_text().splitlines(keepends=True)
        Path(out, "metrics.jsonl").write_text("".join(edit(lines)))
        ran = train(out, "--resume", "--steps", "5")
        cases.append(Case(f"metrics.jsonl {name}, then --resume", "refused: does not match the checkpoint",
                          *_refused(ran, "does not match the checkpoint"), ran.seconds, OWNER))  # fmt: skip
    out = os.path.join(work, "history-utf8")
    train(out, "--steps", "2", "--checkpoint-interval", "1")
    Path(out, "metrics.jsonl").write_bytes(b"\xff\xfe\n" + Path(out, "metrics.jsonl").read_bytes())
    ran = train(out, "--resume", "--steps", "3")
    cases.append(Case("metrics.jsonl invalid UTF-8", "refused naming the line", *_refused(ran, "line 1"),
                      ran.seconds, OWNER))  # fmt: skip
    out = os.path.join(work, "history-cut")
    train(out, "--steps", "2", "--checkpoint-interval", "1")
    with open(Path(out, "metrics.jsonl"), "a") as file:
        file.write('{"step": 3, "loss": 5.')  # a kill during the append
    ran = train(out, "--resume", "--steps", "3")
    kept = _lines(out) == 3
    result = judged(ran, ok=lambda r: r.rc == 0 and kept)
    cases.append(Case("metrics.jsonl last line cut short", "dropped, resumes", *result, ran.seconds, OWNER))
    cases.append(_checkpoint_step_case(work))
    return cases


def _checkpoint_step_case(work: str) -> Case:
    out = os.path.join(work, "badstep")
    train(out, "--steps", "2", "--checkpoint-interval", "1")
    ran = python(
        f"""
        import torch
        path = {str(Path(out, "checkpoint.pt"))!r}
        state = torch.load(path, weights_only=True); state["step"] = -5; torch.save(state, path)
        print("ok|edited")
        """
    )
    ran = train(out, "--resume", "--steps", "3")
    return Case(
        "checkpoint step -5", "refused naming the field", *_refused(ran, "step -5"), ran.seconds, OWNER
    )


# ----------------------------------------------------------------------------------------- sizes, library
SNIPPETS: dict[str, tuple[str, str]] = {
    "MemoryTracker while another thread steps Adam": (
        "ok: the same peak as alone",
        """
        import threading, torch, microbatch as mb
        def peak(other):
            model = torch.nn.Linear(16, 16); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            big = [torch.nn.Parameter(torch.randn(1024, 1024))]; adam = torch.optim.Adam(big)
            go, done = threading.Event(), threading.Event()
            def b():
                go.wait(); big[0].grad = torch.ones_like(big[0]); adam.step(); done.set()
            t = threading.Thread(target=b); t.start()
            with mb.MemoryTracker(model=model, optimizer=opt) as tracker:
                model(torch.randn(4, 16)).sum().backward(); go.set()
                if other: done.wait()
                opt.step()
            go.set(); t.join(); return tracker.peak_bytes
        a, b = peak(False), peak(True)
        print(("ok" if a == b else "silent wrong") + f"|alone {a:,} B, beside Adam {b:,} B")
        """,
    ),
    "parse_bytes('1e400GiB')": (
        "clear error",
        """
        import microbatch as mb
        try:
            mb.parse_bytes("1e400GiB"); print("silent wrong|accepted")
        except mb.errors.ConfigError as e:
            print(f"clear error|{str(e)[:90]}")
        """,
    ),
    "cached_backward on an empty batch": (
        "clear error",
        """
        import torch
        from microbatch.accumulate.cached import cached_backward
        from microbatch.errors import ConfigError
        try:
            cached_backward(torch.nn.Linear(2, 2), torch.zeros(0, 2), lambda r: r.sum(), micro_batch_size=2)
            print("silent wrong|accepted")
        except ConfigError as e:
            print(f"clear error|{e}")
        """,
    ),
    "config.json num_hidden_layers 10^9": (
        "clear error at once",
        """
        import json, tempfile, os
        from microbatch.hf.configs import architecture_config
        from microbatch.errors import ConfigError
        path = os.path.join(tempfile.mkdtemp(), "config.json")
        json.dump({"model_type": "llama", "num_hidden_layers": 10**9}, open(path, "w"))
        try:
            architecture_config(path); print("silent wrong|accepted")
        except ConfigError as e:
            print(f"clear error|{str(e)[-90:]}")
        """,
    ),
    "planner stash: SIGTERM and a dead process's file": (
        "ok: removed",
        """
        import os, signal, subprocess, sys, tempfile, glob, torch
        from microbatch.profile import stash
        tmp = tempfile.mkdtemp(); os.environ["TMPDIR"] = tmp; tempfile.tempdir = None
        code = ("import time, torch; from microbatch.profile import stash\\n"
                "with stash.preserved(torch.nn.Linear(64, 64)):\\n"
                "    print('in', flush=True); time.sleep(600)\\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
        p.stdout.readline(); p.send_signal(signal.SIGTERM); p.wait()
        after_term = glob.glob(os.path.join(tmp, "microbatch-stash-*.pt"))
        q = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)
        q.stdout.readline(); q.kill(); q.wait()
        killed = glob.glob(os.path.join(tmp, "microbatch-stash-*.pt"))
        with stash.preserved(torch.nn.Linear(4, 4)):
            pass
        left = glob.glob(os.path.join(tmp, "microbatch-stash-*.pt"))
        ok = p.returncode == 143 and not after_term and len(killed) == 1 and not left
        print(("ok" if ok else "silent wrong") + f"|SIGTERM exit {p.returncode}, left {len(after_term)}; "
              f"kill -9 left {len(killed)}, cleaned at next start: {not left}")
        """,
    ),
}


def size_cases(work: str) -> list[Case]:
    cases = []
    for name, (expected, code) in SNIPPETS.items():
        ran = python(code, timeout=120)
        cases.append(Case(name, expected, *snippet_outcome(ran), ran.seconds, OWNER))
    checks: list[tuple[str, list[str], tuple[str, ...]]] = [
        ("train --memory 1e400GiB", ["train", *TINY, "--memory", "1e400GiB"], ("more than any machine",)),
        (
            "train --batch 10^12",
            ["train", "--model", "gpt-nano", "--batch", str(10**12)],
            ("at most --batch",),
        ),
        ("bench --timeout nan", ["bench", "--timeout", "nan"], ("--timeout",)),
        (
            "bench --output /proc/nope/x.md",
            ["bench", "--quick", "--output", "/proc/nope/x.md"],
            ("--output",),
        ),
    ]
    for name, argv, fragments in checks:
        ran = (
            cli(*argv, "--out", os.path.join(work, "sizes")) if argv[0] == "train" else cli(*argv, timeout=60)
        )
        result = _refused(ran, *fragments)
        if result[0] == "clear error" and ran.seconds > 60:
            result = ("hang", f"refused only after {ran.seconds:.0f} s")
        cases.append(Case(name, "clear error within seconds", *result, ran.seconds, OWNER))
    return cases


def run_cases(work: str) -> list[Case]:
    """Every case of issue 22 that is not the Accumulator's own."""
    work = os.path.join(work, "runs")
    os.makedirs(work)
    return [*folder_cases(work), *signal_cases(work), *history_cases(work), *size_cases(work)]
