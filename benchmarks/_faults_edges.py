"""Faults of issue 35, at the run's edges: the lock file deleted, a folder swapped for a link, output
that fails, saved state edited or damaged, signals while planning, a rank killed under torchrun.

Imported by faults.py (``python benchmarks/faults.py --only edges``); each case runs real processes.
Outcomes beyond faults.py's: ``security`` (a write went through a link), ``leak`` (a stash, marker
or lock left behind), ``unclear`` (refused or stopped, but the words are wrong or blame a bug).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import faults  # benchmarks/faults.py
from _faults_clear import _case, clear_cases
from _faults_runs import _lines, _popen_train, _wait_for
from faults import TINY, Case, Ran, judged, python, snippet_outcome, train

OWNER = "edges"


def _steps(out: str) -> list[int]:
    path = Path(out, "metrics.jsonl")
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _refusal(ran: Ran, *words: str) -> tuple[str, str]:
    outcome, detail = judged(ran, ok=lambda r: False)
    if outcome == "clear error" and not all(word in ran.err for word in words):
        return "unclear", f"wants {words}: {detail}"
    if "This is a bug" in ran.err:
        return "unclear", detail
    return outcome, detail


def _second_writer(
    work: str, name: str, second: Callable[[str], Ran], after_checkpoint: bool
) -> tuple[str, str]:
    """A long first run; its lock file deleted; a second writer; then the first is stopped (SIGTERM)."""
    out = os.path.join(work, name)
    interval = "2" if after_checkpoint else "100000"
    first = _popen_train(out, "--steps", "100000", "--checkpoint-interval", interval)
    _wait_for(lambda: Path(out, "checkpoint.pt").is_file() if after_checkpoint else _lines(out) >= 1, first)
    Path(out, ".microbatch.lock").unlink(missing_ok=True)
    ran = second(out)
    os.killpg(first.pid, signal.SIGTERM)
    first.communicate(timeout=300)
    steps = _steps(out)
    if first.returncode != 143 or not steps or steps != list(range(1, len(steps) + 1)):
        return "data lost", f"first run: exit {first.returncode}, steps {steps[:20]}"
    return _refusal(ran, "in use by another microbatch run")


def writer_cases(work: str, cases: list[Case]) -> None:
    for name, second, after in (
        ("lock deleted, new run before the first checkpoint", lambda out: train(out, "--steps", "3"), False),
        ("lock deleted, new run after a checkpoint", lambda out: train(out, "--steps", "3"), True),
        ("lock deleted, --resume", lambda out: train(out, "--resume", "--steps", "20"), True),
    ):
        tag = name.replace(" ", "-").replace(",", "")
        _case(
            cases,
            name,
            "refused; first run's metrics intact",
            lambda tag=tag, second=second, after=after: _second_writer(work, tag, second, after),
        )


def _swapped_folder(work: str) -> tuple[str, str]:
    out, moved, victim = (os.path.join(work, name) for name in ("swap", "swap-moved", "swap-victim"))
    os.makedirs(victim)
    run = _popen_train(out, "--steps", "100000", "--checkpoint-interval", "2")
    _wait_for(lambda: Path(out, "checkpoint.pt").is_file(), run)
    os.rename(out, moved)
    os.symlink(victim, out)
    _, err = run.communicate(timeout=300)
    if os.listdir(victim):
        return "security", f"written through the link: {os.listdir(victim)}"
    line = (err.strip().splitlines() or [""])[-1]
    if run.returncode != 2 or "moved or replaced" not in line or moved not in line:
        return "unclear", f"exit {run.returncode}: {line[:140]}"
    resumed = train(moved, "--resume", "--steps", str(len(_steps(moved)) + 1))
    return judged(resumed, ok=lambda r: r.rc == 0)[0], line


def _full_disk(work: str, *, hang_up: bool) -> tuple[str, str]:
    out = os.path.join(work, "hup" if hang_up else "full")
    steps = "100000" if hang_up else "6"
    with open("/dev/full", "w") as full:
        process = subprocess.Popen(
            [sys.executable, "-m", "microbatch", "train", *TINY[:-1], "--steps", steps, "--out", out],
            stdout=full,
            stderr=full,
            env=faults.environment(),
            cwd=str(faults.ROOT),
        )
        if hang_up:
            _wait_for(lambda: _lines(out) >= 2, process)  # type: ignore[arg-type]
            process.send_signal(signal.SIGHUP)
        code = process.wait(timeout=300)
    wanted = 129 if hang_up else 0
    if code != wanted or not Path(out, "summary.json").is_file():
        return (
            "data lost",
            f"exit {code} (wanted {wanted}); summary.json: {Path(out, 'summary.json').is_file()}",
        )
    return "ok", f"exit {code}, summary.json written"


def output_cases(work: str, cases: list[Case]) -> None:
    _case(
        cases,
        "run folder renamed, a link put in its place",
        "no write through the link; clear stop",
        lambda: _swapped_folder(work),
    )
    _case(
        cases,
        "stdout and stderr on a full disk",
        "trains on, exit 0",
        lambda: _full_disk(work, hang_up=False),
    )
    _case(
        cases,
        "hang-up with the terminal gone",
        "exit 129 with summary.json",
        lambda: _full_disk(work, hang_up=True),
    )


def _edited(work: str, name: str, edit: Callable[[Path], None], *words: str) -> tuple[str, str]:
    out = os.path.join(work, name)
    train(out, "--steps", "3")
    edit(Path(out))
    ran = train(out, "--resume", "--steps", "4")
    if ran.rc == 0:
        return "silent wrong", "resumed from damaged state"
    return _refusal(ran, *words)


def _flip_bit(folder: Path) -> None:
    import torch

    path = folder / "checkpoint.pt"
    weight = next(iter(torch.load(path, weights_only=True)["model"].values())).contiguous()
    raw = bytearray(path.read_bytes())
    raw[raw.find(weight.view(-1).view(torch.uint8).numpy().tobytes()[:64]) + 17] ^= 4
    path.write_bytes(bytes(raw))


def _edit_metrics(field: str, value: float) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        records[1][field] = value
        records[1]["tokens_per_second"] = records[1]["items"] / records[1]["seconds"]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    return edit


PLAN_SNIPPETS = {
    "Plan.save cut short": """
        import errno, os, tempfile
        from microbatch.planner import Plan
        from microbatch.planner.result import plan_file
        path = os.path.join(tempfile.mkdtemp(), "plan.json")
        Plan.manual(batch_size=8, micro_batch_size=2).save(path)
        before = open(path).read()
        def full(fd): raise OSError(errno.ENOSPC, "full")
        plan_file.os.fsync = full
        try: Plan.manual(batch_size=16, micro_batch_size=2).save(path)
        except OSError: pass
        print("ok|old plan intact" if open(path).read() == before else "data lost|plan truncated")
    """,
    "Plan.apply to another model": """
        import torch
        from microbatch.errors import ConfigError
        from microbatch.planner import Plan
        small, large = torch.nn.Linear(4, 4), torch.nn.Linear(32, 32)
        plan = Plan.manual(batch_size=8, micro_batch_size=2, parameters=20)
        try:
            plan.apply(large, torch.optim.SGD(large.parameters(), lr=0.1)); print("silent wrong|accepted")
        except ConfigError as e: print("clear error|" + str(e)[:120])
    """,
}


def state_cases(work: str, cases: list[Case]) -> None:
    _case(
        cases,
        "one bit flipped in a checkpoint tensor",
        "refused naming the file",
        lambda: _edited(work, "flip", _flip_bit, "checkpoint.pt", "checksum"),
    )
    _case(
        cases,
        "metrics items edited to -500",
        "refused naming the line",
        lambda: _edited(work, "items", _edit_metrics("items", -500), "non-negative"),
    )
    _case(
        cases,
        "metrics loss edited (valid JSON)",
        "refused by the checksum",
        lambda: _edited(work, "loss", _edit_metrics("loss", 1.25), "checksum"),
    )
    for name, code in PLAN_SNIPPETS.items():
        _case(cases, name, "old plan kept / refused", lambda code=code: snippet_outcome(python(code)))


def _planning_signal(work: str, name: str) -> tuple[str, str]:
    out, scratch = os.path.join(work, f"plan-{name}"), os.path.join(work, f"tmp-{name}")
    os.makedirs(scratch)
    env = {**faults.environment(), "TMPDIR": scratch}
    process = subprocess.Popen(
        [sys.executable, "-m", "microbatch", "train", *faults.TINY_PLANNED, "--steps", "2", "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(faults.ROOT),
    )
    _wait_for(lambda: any(n.startswith("microbatch-stash-") for n in os.listdir(scratch)), process, 120)
    process.send_signal(getattr(signal, name))
    process.communicate(timeout=120)
    left = [n for n in os.listdir(scratch) if n.startswith("microbatch-stash-")]
    if left or os.path.exists(out):
        return "leak", f"stash {left}; run folder left: {os.path.exists(out)}"
    return "ok", f"exit {process.returncode}; nothing left"


def _stale_stash(work: str) -> tuple[str, str]:
    scratch = os.path.join(work, "tmp-stale")
    os.makedirs(scratch)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(scratch, f"microbatch-stash-{dead.pid}-x.pt")
    stale.write_bytes(b"x")
    env = {**faults.environment(), "TMPDIR": scratch}
    subprocess.run(
        [sys.executable, "-m", "microbatch", "train", *TINY, "--steps", "1", "--out", f"{work}/st"],
        capture_output=True,
        env=env,
        cwd=str(faults.ROOT),
        timeout=300,
    )
    return ("leak", "still there") if stale.exists() else ("ok", "removed by the next run")


def signal_cases(work: str, cases: list[Case]) -> None:
    for name in ("SIGUSR1", "SIGUSR2", "SIGXCPU"):
        _case(
            cases,
            f"{name} while planning",
            "stash, marker and lock removed",
            lambda name=name: _planning_signal(work, name),
        )
    _case(cases, "stash of a kill -9'd process", "removed by the next run", lambda: _stale_stash(work))


def _torchrun_kill(
    work: str, name: str, extra: tuple[str, ...], restarts: int, *, named: bool = True
) -> tuple[str, str]:
    """Rank 1 killed mid-run; ``named=False``: no --out, the run in runs/MODEL-DATE-TIME under a
    folder of its own (the restarted ranks must find it by their launch's id)."""
    home = os.path.join(work, name)
    if not named:
        os.makedirs(home)

    def out() -> str:
        if named:
            return home
        made = sorted(Path(home, "runs").iterdir()) if Path(home, "runs").is_dir() else []
        return str(made[0]) if len(made) == 1 else os.path.join(home, "runs", f"{len(made)} folders")

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "-m",
        "microbatch",
        "train",
        *TINY,
        "--batch",
        "8",
        "--micro-batch",
        "2",
        "--steps",
        "10",
        "--checkpoint-interval",
        "3",
        *(("--out", home) if named else ()),
        *extra,
    ]
    launch = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=faults.environment(),
        cwd=str(faults.ROOT) if named else home,
    )
    _wait_for(lambda: _lines(out()) >= 4, launch, 300)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent == launch.pid and b"LOCAL_RANK=1" in environ:
            os.kill(int(entry), signal.SIGKILL)
    _, err = launch.communicate(timeout=400)
    if "This is a bug" in err or "internal error" in err:
        return "unclear", "a dead peer reported as a bug"
    if restarts == 0:
        ok = "rank 1 stopped" in err and "resume with" in err
        return ("clear error", "rank 1 stopped; resume with ...") if ok else ("unclear", err[-140:])
    if launch.returncode != 0 or _steps(out()) != list(range(1, 11)):
        return "data lost", f"exit {launch.returncode}; steps {_steps(out())} in {out()}"
    return "ok", "completed by itself from the last checkpoint"


def torchrun_cases(work: str, cases: list[Case]) -> None:
    for name, extra, restarts, named in (
        ("torchrun --max-restarts 1, rank 1 killed (DDP)", (), 1, True),
        ("torchrun --max-restarts 1, rank 1 killed (pipeline 2)", ("--pipeline", "2"), 1, True),
        ("torchrun, rank 1 killed, no restarts (DDP)", (), 0, True),
        ("torchrun --max-restarts 1, rank 1 killed, no --out (DDP)", (), 1, False),
    ):
        tag = name.replace(" ", "-").replace(",", "").replace("(", "").replace(")", "")
        _case(
            cases,
            name,
            "completes / names the dead rank",
            lambda tag=tag, extra=extra, restarts=restarts, named=named: _torchrun_kill(
                work, tag, extra, restarts, named=named
            ),
        )


def edge_cases(work: str) -> list[Case]:
    cases: list[Case] = []
    for group in (writer_cases, output_cases, state_cases, signal_cases, torchrun_cases, clear_cases):
        group(work, cases)
    return cases
