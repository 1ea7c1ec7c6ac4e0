"""Faults: every fault a user or a cluster can cause (issue #11), injected, with the answer they get.

Each case injects one fault and sorts what happened into one outcome:

    ok            the work goes on (or is refused before anything starts) and the result is right
    clear error   one line that names the problem and the fix, exit status 2, nothing lost
    launcher traceback
                  torchrun's own launcher printed its SignalException traceback and exited 1 after
                  our workers stopped cleanly and saved (not avoidable from the workers: see
                  torchrun_interrupt_case)
    traceback     a raw traceback, or a message that is misleading
    hang          no answer within the case's time limit
    silent wrong  it "works" but the result is wrong (a gradient, a count, a leaked file)
    data lost     finished work that cannot be resumed

Library cases run in a fresh Python process each (so a monkeypatched fault stays inside it);
command-line cases run ``python -m microbatch ...`` with this checkout's src/ first on the path.
Kills: ``kill -9`` at random moments of tiny ``microbatch train`` runs (gpt-nano, a few steps,
a checkpoint every step), and kills the moment a checkpoint's temporary file appears; each run is
then resumed and its final checkpoint compared bitwise with an uninterrupted run's.

Target: 0 data lost, 0 silent wrong, 0 hangs, 0 tracebacks.

    python benchmarks/faults.py [--kills 20] [--write-kills 5] [--seed 0] [--quick] [--json] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults_window  # benchmarks/faults_window.py: a window's life (issue 22)
import results  # benchmarks/results.py

ROOT = Path(__file__).resolve().parent.parent
SECTION_TITLE = "Faults"
RUNS_SECTION_TITLE = "Faults: run folders and saved state"
EDGES_SECTION_TITLE = "Faults: the run's edges"
OUTCOMES = (
    "ok", "clear error", "launcher traceback", "traceback", "hang", "silent wrong", "data lost",
    "security", "leak", "unclear",  # issue 35's cases (benchmarks/_faults_edges.py)
)  # fmt: skip
# A tiny training run: seconds of compute, 3 micro-batches per step (3 + 3 + 2), no planning.
TINY = ["--model", "gpt-nano", "--batch", "8", "--micro-batch", "3", "--no-progress"]
# The same with the planner (a budget under which it accumulates).
TINY_PLANNED = ["--model", "gpt-nano", "--batch", "8", "--memory", "1600KiB", "--no-progress"]
TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    outcome: str
    detail: str
    seconds: float
    owner: str  # who fixes it in #11: "library" (faults) or "training" (the training loop)


@dataclass(frozen=True)
class Ran:
    rc: int | None  # None: killed at the time limit
    out: str
    err: str
    seconds: float


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(
    argv: Sequence[str],
    *,
    timeout: float = 120.0,
    limit_file_bytes: int | None = None,
    cwd: str | None = None,
) -> Ran:
    """Run a command to the end or the time limit (then it is killed: a hang)."""

    def limits() -> None:
        if limit_file_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))

    began = time.perf_counter()
    process = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        cwd=cwd or str(ROOT),
        preexec_fn=limits,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
        return Ran(process.returncode, out, err, time.perf_counter() - began)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return Ran(None, out, err, time.perf_counter() - began)


def cli(*args: str, **options: Any) -> Ran:
    return run([sys.executable, "-m", "microbatch", *args], **options)


def python(code: str, **options: Any) -> Ran:
    """A snippet in a fresh interpreter; it prints its outcome as the last line: OUTCOME|detail."""
    return run([sys.executable, "-c", textwrap.dedent(code)], **options)


def judged(ran: Ran, *, ok: Callable[[Ran], bool], clear_is: str = "clear error") -> tuple[str, str]:
    """The outcome of a command: hang, traceback, ok (by ``ok``), clear error (status 2, one line)."""
    last = (ran.err.strip().splitlines() or [""])[-1][:160]
    if ran.rc is None:
        return "hang", f"no answer in {ran.seconds:.0f} s"
    if TRACEBACK in ran.err or TRACEBACK in ran.out:
        return "traceback", last
    if ok(ran):
        return "ok", f"exit {ran.rc}"
    if ran.rc == 2 and "error" in last:
        return clear_is, last
    return "silent wrong", f"exit {ran.rc}: {last}"


def snippet_outcome(ran: Ran) -> tuple[str, str]:
    if ran.rc is None:
        return "hang", f"no answer in {ran.seconds:.0f} s"
    lines = [line for line in ran.out.strip().splitlines() if "|" in line]
    if ran.rc != 0 or not lines:
        tail = (ran.err.strip().splitlines() or ["(no output)"])[-1][:160]
        return "traceback", tail
    outcome, _, detail = lines[-1].partition("|")
    return outcome, detail


# ----------------------------------------------------------------------------------------- library
LIBRARY_PRELUDE = """
import copy, logging, math, torch
from torch import nn
import microbatch as mb
torch.manual_seed(0)
def verdict(outcome, detail=""):
    print(f"{outcome}|{detail}")
x = torch.randn(12, 5, dtype=torch.float64); y = torch.randn(12, 1, dtype=torch.float64)
def reference(model, max_norm=None):
    ref = copy.deepcopy(model); nn.functional.mse_loss(ref(x), y).backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    return [p.grad.clone() for p in ref.parameters()]
def close(a, b):
    return all(torch.allclose(u, v, rtol=1e-10, atol=1e-12) for u, v in zip(a, b))
"""

LIBRARY_CASES: dict[str, tuple[str, str]] = {
    "optimizer raises in step(), retry": (
        "ok: gradients restored, retry exact",
        """
        class Fail(torch.optim.SGD):
            left = 1
            def step(self, closure=None):
                if self.left:
                    self.left -= 1; raise RuntimeError("optimizer failed")
                return super().step(closure)
        model = nn.Linear(5, 1).double(); expected = reference(model, 0.05)
        opt = Fail(model.parameters(), lr=0.0); seen = []
        opt.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in model.parameters()]))
        acc = mb.Accumulator(model, opt, steps=3, max_grad_norm=0.05)
        for i in range(3):
            acc.backward(nn.functional.mse_loss(model(x[4*i:4*i+4]), y[4*i:4*i+4]), items=4)
        try:
            acc.step()
        except RuntimeError:
            pass
        acc.step()
        verdict("ok" if close(seen[-1], expected) else "silent wrong", "retry vs full batch")
        """,
    ),
    "optimizer without 'lr'": (
        "ok: WindowStats.lr is None",
        """
        class NoLr(torch.optim.Optimizer):
            def __init__(self, ps): super().__init__(ps, {"scale": 0.5})
            @torch.no_grad()
            def step(self, closure=None):
                for g in self.param_groups:
                    for p in g["params"]: p.sub_(0.5 * p.grad)
        model = nn.Linear(5, 1).double(); acc = mb.Accumulator(model, NoLr(model.parameters()), steps=1)
        acc.backward(nn.functional.mse_loss(model(x), y), items=12); stats = acc.step()
        verdict("ok" if stats.lr is None else "silent wrong", str(stats))
        """,
    ),
    "GradScaler, parameters outside the optimizer": (
        "ok: only the optimizer's gradients unscaled and clipped",
        """
        class Two(nn.Module):
            def __init__(self): super().__init__(); self.a = nn.Linear(5, 1); self.b = nn.Linear(5, 1)
            def forward(self, t): return self.a(t) + self.b(t)
        model = Two().double(); ref = copy.deepcopy(model); nn.functional.mse_loss(ref(x), y).backward()
        expected = [p.grad.clone() for p in ref.a.parameters()]
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected]))
        expected = [g * min(1.0, 0.05 / (float(norm) + 1e-6)) for g in expected]
        opt = torch.optim.SGD(model.a.parameters(), lr=0.0); seen = []
        opt.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in model.a.parameters()]))
        acc = mb.Accumulator(model, opt, steps=1, max_grad_norm=0.05,
                             scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))
        acc.backward(nn.functional.mse_loss(model(x), y), items=12); acc.step()
        verdict("ok" if close(seen[-1], expected) else "silent wrong", "clipped gradient vs reference")
        """,
    ),
    "correct_batchnorm_momentum in a manual loop": (
        "ok: running statistics decay once per window",
        """
        model = nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3, momentum=0.1)).double()
        acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=4,
                             correct_batchnorm_momentum=True)
        start = model[1].running_mean.clone()
        with torch.no_grad(): mean = model[0](x).mean(0)
        for _ in range(4): acc.backward(model(x).pow(2).mean(), items=12)
        acc.step()
        good = torch.allclose(model[1].running_mean, 0.9 * start + 0.1 * mean, rtol=1e-12, atol=1e-12)
        verdict("ok" if good else "silent wrong", "running mean after one window")
        """,
    ),
    "loader raises mid-window": (
        "ok: acc.discard_window(), then exact",
        """
        model = nn.Linear(5, 1).double(); expected = reference(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0); seen = []
        opt.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in model.parameters()]))
        acc = mb.Accumulator(model, opt, steps=3)
        def broken():
            yield (x[:4] * 3, y[:4]); yield (x[4:8], y[4:8]); raise OSError("disk gone")
        try:
            for m in acc.iterate(broken()):
                acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
        except OSError:
            pass
        acc.discard_window(); acc.state_dict()
        for m in acc.iterate([(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])]):
            acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
            if m.is_last: acc.step()
        verdict("ok" if close(seen[-1], expected) else "silent wrong", "next window vs full batch")
        """,
    ),
    "loader refilling one buffer in place": (
        "ok: the user sees [0, 1, 2]",
        """
        class Refill:
            def __init__(self): self.buf = torch.zeros(1, 1)
            def __len__(self): return 3
            def __iter__(self):
                for i in range(3): self.buf.fill_(i); yield self.buf
        model = nn.Linear(1, 1)
        acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=3)
        seen = []
        for m in acc.iterate(Refill()):
            seen.append(float(m.batch)); acc.backward(model(m.batch).sum(), items=1)
            if m.is_last: acc.step()
        verdict("ok" if seen == [0.0, 1.0, 2.0] else "silent wrong", f"saw {seen}")
        """,
    ),
    "stateful loader saved beside state_dict()": (
        "ok: no micro-batch skipped on resume",
        """
        class Counting:
            fetched = 0
            def __len__(self): return 6
            def __iter__(self):
                for i in range(6): self.fetched += 1; yield torch.full((1, 1), float(i))
        model = nn.Linear(1, 1)
        acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2)
        loader = Counting(); saved = []
        for m in acc.iterate(loader):
            acc.backward(model(m.batch).sum(), items=1)
            if m.is_last: acc.step(); saved.append((acc.state_dict()["window"], loader.fetched))
        good = all(fetched == 2 * window for window, fetched in saved)
        verdict("ok" if good else "data lost", f"(window, fetched) at each save: {saved}")
        """,
    ),
    "parse_bytes: 1.5 / 5e-1 / 80% / 1 / 1.0": (
        "1.5 refused; 5e-1, 80%, 1.0 fractions of free memory; 1 byte",
        """
        from microbatch.memory import device_free_bytes
        try:
            mb.parse_bytes("1.5"); refused = False
        except mb.ConfigError:
            refused = True
        free = device_free_bytes("cpu")
        near = lambda a, b: abs(a - b) <= 0.05 * free
        good = (refused and near(mb.parse_bytes("5e-1"), free / 2) and near(mb.parse_bytes("80%"), 0.8 * free)
                and mb.parse_bytes("1") == 1 and near(mb.parse_bytes("1.0"), free))
        verdict("ok" if good else "silent wrong", "one rule")
        """,
    ),
    "plan() with make_batch returning wrong sizes": (
        "clear error before profiling",
        """
        from microbatch.workload import seed_linear
        w = seed_linear(); make = w.make_batch; w.make_batch = lambda b: make(b + 1)
        try:
            mb.plan(w, batch=8, memory="64MiB"); verdict("silent wrong", "planned")
        except mb.WorkloadError as e:
            verdict("clear error", str(e)[:120])
        """,
    ),
    "Workload(optimizer=<instance>)": (
        "ok: planned, the instance never stepped",
        """
        from microbatch.workload import seed_linear
        w = seed_linear(); opt = torch.optim.SGD(w.model.parameters(), lr=0.1, momentum=0.9); calls = []
        opt.register_step_pre_hook(lambda *_: calls.append(1)); w.optimizer = opt
        p = mb.plan(w, batch=8, memory="64MiB")
        verdict("ok" if not calls and not opt.state else "silent wrong", f"micro-batch {p.micro_batch_size}")
        """,
    ),
    "out of memory in every trial with b > 1": (
        "ok: smaller micro-batches tried, b = 1 chosen",
        """
        from microbatch.planner import planning as trial
        from microbatch.workload import seed_linear
        real = trial.run_trial
        def fake(w, c, **options):
            if c.micro_batch_size > 1: raise torch.OutOfMemoryError("simulated")
            return real(w, c, **options)
        trial.run_trial = fake
        try:
            p = mb.plan(seed_linear(), batch=32, memory="64MiB")
            verdict("ok" if p.micro_batch_size == 1 else "silent wrong", f"{p.micro_batch_size} x {p.steps}")
        except mb.InfeasibleBudgetError as e:
            verdict("silent wrong", "gave up: " + str(e)[:100])
        """,
    ),
    "budget below weights + optimizer state": (
        "clear error before profiling, minimum marked 'at least'",
        """
        import time
        from microbatch.planner import planning as trial
        from microbatch.models.workloads import lm_varlen
        w = lm_varlen(); weights = sum(p.numel() * p.element_size() for p in w.model.parameters())
        trial.profile_workload = lambda *a, **k: verdict("silent wrong", "profiled first") or exit(0)
        try:
            mb.plan(w, batch=8, memory=4 * weights - 1)
        except mb.InfeasibleBudgetError as e:
            good = e.minimum_is_lower_bound and "at least" in str(e) and "AdamW state" in str(e)
            verdict("clear error" if good else "silent wrong", str(e)[:120])
        """,
    ),
    "errors exported from microbatch": (
        "ok: mb.InfeasibleBudgetError, mb.UsageError, ...",
        """
        names = ["InfeasibleBudgetError", "UsageError", "ConfigError", "WorkloadError", "ResumeError"]
        verdict("ok" if all(hasattr(mb, n) for n in names) else "silent wrong", ", ".join(names))
        """,
    ),
}


def library_cases() -> list[Case]:
    cases = []
    for name, (expected, code) in {**LIBRARY_CASES, **faults_window.WINDOW_CASES}.items():
        ran = python(LIBRARY_PRELUDE + textwrap.dedent(code), timeout=120)
        outcome, detail = snippet_outcome(ran)
        cases.append(Case(name, expected, outcome, detail, ran.seconds, "library"))
    return cases


# ----------------------------------------------------------------------------------------- command line
def command_line_cases(work: str) -> list[Case]:
    cases: list[Case] = []

    def add(name: str, expected: str, judged_: tuple[str, str], ran: Ran, owner: str = "library") -> None:
        cases.append(Case(name, expected, judged_[0], judged_[1], ran.seconds, owner))

    ran = cli("plan", "seed-linear", "--batch", "1000000000000", "--memory", "10MiB", timeout=60)
    add("plan --batch 1e12", "clear error within seconds", judged(ran, ok=lambda r: False), ran)
    module = Path(work, "faulty_workloads.py")
    module.write_text(
        "from microbatch.workload import Workload, seed_linear\n"
        "def broken():\n"
        "    base = seed_linear()\n"
        "    def make_batch(b):\n"
        "        raise ValueError('my data file is missing')\n"
        "    return Workload(model=base.model, make_batch=make_batch, loss=base.loss)\n"
    )
    for command in (
        ["verify", "--batch", "8", "--steps", "2"],
        ["plan", "--batch", "8", "--memory", "64MiB"],
    ):
        ran = cli(command[0], "faulty_workloads:broken", *command[1:], cwd=work)
        named = judged(ran, ok=lambda r: False)
        if named[0] == "clear error" and "make_batch" not in named[1]:
            named = ("traceback", "does not name make_batch: " + named[1])
        add(f"{command[0]}: user code raises", "clear error naming make_batch, exit 2", named, ran)
    ran = cli("plan", "seed-linear", "--batch", "8", "--memory", "64MiB", "--plot", "/nonexistent/x.png")
    fast = judged(ran, ok=lambda r: False)
    if "does not exist" not in ran.err:
        fast = (fast[0] if fast[0] != "clear error" else "traceback", fast[1])
    add("plan --plot to an unwritable path", "clear error before planning", fast, ran)
    cases += training_cases(work)
    return cases


def train(out: str, *extra: str, timeout: float = 180, flags: Sequence[str] = TINY, **options: Any) -> Ran:
    return cli("train", *flags, "--out", out, *extra, timeout=timeout, **options)


def summary_of(out: str) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(Path(out, "summary.json").read_text()))
    return {}


def training_cases(work: str) -> list[Case]:
    cases: list[Case] = []

    def add(name: str, expected: str, result: tuple[str, str], ran: Ran) -> None:
        cases.append(Case(name, expected, result[0], result[1], ran.seconds, "training"))

    done = os.path.join(work, "done")
    train(done, "--steps", "4", "--checkpoint-interval", "1")
    tokens_first = summary_of(done).get("tokens", 0)
    Path(done, ".checkpoint.pt.999.deadbeef.tmp").write_bytes(b"\0" * 1024)
    more = train(done, "--resume", "--steps", "6")
    tokens_total = summary_of(done).get("tokens", 0)
    leaked = glob.glob(os.path.join(done, ".checkpoint.pt.*.tmp"))
    add(
        "leftover .checkpoint.pt.*.tmp on resume",
        "removed",
        ("silent wrong", "left") if leaked else judged(more, ok=lambda r: r.rc == 0),
        more,
    )
    add(
        "summary.json across resumes",
        "tokens of the whole run",
        ("ok", f"{tokens_first} -> {tokens_total}")
        if tokens_total > tokens_first
        else ("silent wrong", f"{tokens_first} -> {tokens_total}"),
        more,
    )
    ran = train(done, "--resume", "--steps", "5")
    add("--steps 5 on a finished 6-step run", "clear error", judged(ran, ok=lambda r: False), ran)
    ran = train(os.path.join(work, "lr"), "--steps", "3", "--lr", "inf")
    add("--lr inf", "clear error", judged(ran, ok=lambda r: False), ran)
    planned = os.path.join(work, "planned")
    train(planned, "--steps", "2", "--checkpoint-interval", "1", flags=TINY_PLANNED)
    ran = train(planned, "--resume", "--steps", "3", "--memory", "1200KiB", flags=TINY_PLANNED)
    replanned = summary_of(planned).get("plan", {}).get("budget_bytes") == 1200 * 1024
    add(
        "--resume --memory X", "re-planned or refused", judged(ran, ok=lambda r: r.rc == 0 and replanned), ran
    )
    ran = cli("train", *TINY, "--steps", "2", "--device", "meta", "--out", os.path.join(work, "meta"))
    add("--device meta", "clear error", judged(ran, ok=lambda r: False), ran)
    garbage = os.path.join(work, "garbage")
    os.makedirs(garbage, exist_ok=True)
    Path(garbage, "checkpoint.pt").write_bytes(os.urandom(4096))
    ran = train(garbage, "--resume")
    verdict = judged(ran, ok=lambda r: False)
    if "weights_only=False" in ran.err:
        verdict = ("traceback", "advises weights_only=False")
    add("garbage checkpoint.pt", "clear error, never 'weights_only=False'", verdict, ran)
    ran = train(
        os.path.join(work, "full"), "--steps", "3", "--checkpoint-interval", "1", limit_file_bytes=200_000
    )
    add(
        "full disk (file size limit)",
        "clear error, earlier checkpoint intact",
        judged(ran, ok=lambda r: False),
        ran,
    )
    cases += [sigterm_case(work), *training_oom_cases(work), skipped_windows_case(work)]
    cases += torchrun_cases(work)
    return cases


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "microbatch", *args]


def torchrun_cases(work: str) -> list[Case]:
    """Two gloo ranks: no false warnings from the planner; Ctrl-C saves and exits 130 without a traceback."""
    out = os.path.join(work, "ddp")
    ran = run(torchrun("train", *TINY_PLANNED, "--steps", "2", "--out", out), timeout=300)
    false = ran.err.count("not wrapped") + ran.err.count("neither DistributedDataParallel")
    verdict = judged(ran, ok=lambda r: r.rc == 0 and false == 0)
    if verdict[0] == "silent wrong" and ran.rc == 0:
        verdict = ("traceback", f"{false} false 'not wrapped in DDP' warnings")
    cases = [
        Case("torchrun 2 ranks: planner warnings", "no false DDP warnings", *verdict, ran.seconds, "training")
    ]
    cases.append(torchrun_interrupt_case(work))
    return cases


def torchrun_interrupt_case(work: str) -> Case:
    """Ctrl-C to torchrun: the workers save and exit 130; the launcher's own traceback is classified apart.

    torchrun starts each worker in a session of its own, so a terminal's Ctrl-C (SIGINT to the
    foreground group) reaches the launcher only. Its handler (torch.distributed.elastic.multiprocessing
    .api._terminate_process_handler, for every signal in --signals-to-handle, SIGTERM included) raises
    SignalException; the agent forwards the signal to the workers, waits for them, then re-raises it
    and the launcher exits 1 with that traceback, however the workers exit. Judged: each traceback
    in the output is that SignalException of the launcher's own pid, and the workers saved.
    """
    out = os.path.join(work, "ddp-int")
    began = time.perf_counter()
    process = subprocess.Popen(
        torchrun("train", *TINY, "--steps", "400", "--checkpoint-interval", "1000", "--out", out),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        cwd=str(ROOT),
        start_new_session=True,
    )
    metrics = Path(out, "metrics.jsonl")
    while process.poll() is None and time.perf_counter() - began < 180:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    expected = "workers save, exit 130, resume command"
    try:
        _, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Case("torchrun Ctrl-C", expected, "hang", "", 90, "training")
    outcome, detail = _torchrun_interrupt_outcome(process, err, out)
    return Case("torchrun Ctrl-C", expected, outcome, detail, time.perf_counter() - began, "training")


def _torchrun_interrupt_outcome(process: subprocess.Popen[str], err: str, out: str) -> tuple[str, str]:
    launcher = f"SignalException: Process {process.pid} got signal"
    tracebacks, launchers = err.count(TRACEBACK), err.count(launcher)
    saved = "Resume with: microbatch train --resume" in err and Path(out, "checkpoint.pt").exists()
    if tracebacks > launchers:
        return (
            "traceback",
            f"exit {process.returncode}, {tracebacks - launchers} traceback(s) not the launcher's",
        )
    if not saved:
        return "data lost", f"exit {process.returncode}, no checkpoint or no resume command"
    if launchers:
        return "launcher traceback", f"torchrun's own; workers saved; launcher exit {process.returncode}"
    return ("ok" if process.returncode == 130 else "traceback"), f"exit {process.returncode}"


def sigterm_case(work: str) -> Case:
    out = os.path.join(work, "sigterm")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "microbatch",
            "train",
            *TINY,
            "--steps",
            "400",
            "--checkpoint-interval",
            "1000",
            "--out",
            out,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        cwd=str(ROOT),
    )
    began = time.perf_counter()
    metrics = Path(out, "metrics.jsonl")
    while process.poll() is None and time.perf_counter() - began < 120:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        return Case("SIGTERM mid-run", "saved, resumable, exit 143", "hang", "", 60, "training")
    saved = Path(out, "checkpoint.pt").exists()
    if TRACEBACK in err:
        outcome, detail = "traceback", err.strip().splitlines()[-1][:160]
    elif not saved:
        outcome, detail = "data lost", f"exit {process.returncode}, no checkpoint"
    else:
        outcome, detail = "ok", f"exit {process.returncode}, checkpoint saved"
    return Case(
        "SIGTERM mid-run",
        "saved, resumable, exit 143",
        outcome,
        detail,
        time.perf_counter() - began,
        "training",
    )


TRAIN_IN_PROCESS = """
import os, torch
from microbatch.models import gpt
from microbatch.training import TrainConfig, train
original = gpt.GPT.forward
calls = [0]
def forward(self, *args, **kwargs):
    calls[0] += 1
    {inject}
    return original(self, *args, **kwargs)
gpt.GPT.forward = forward
try:
    summary = train(TrainConfig(model="gpt-nano", batch=8, micro_batch=3, steps={steps},
                                out={out!r}, checkpoint_interval=1))
    done = str(summary.steps_done) + " steps, " + str(summary.replans) + " re-plans"
    print("{done_outcome}|finished " + done)
except Exception as error:
    from microbatch.errors import MicrobatchError
    kind = "clear error" if isinstance(error, MicrobatchError) else "traceback"
    print(kind + "|" + type(error).__name__ + ": " + str(error).splitlines()[0][:120])
"""


def training_oom_cases(work: str) -> list[Case]:
    """A manual plan (--micro-batch 3) out of memory: in a training forward, and while evaluating.

    Forward calls: step 1 runs 3 micro-batches (calls 1-3), its evaluation 4 batches (4-7), step 2's
    micro-batches are calls 8-10. Training: re-planned (1 re-plan), same window again. Evaluating:
    the step is done, the evaluation runs again in pieces (no re-plan).
    """
    cases = []
    for name, inject, replans in (
        ("training-time out of memory (manual plan)", "calls[0] == 9 and self.training", 1),
        ("out of memory while evaluating (manual plan)", "calls[0] == 5 and not self.training", 0),
    ):
        code = TRAIN_IN_PROCESS.format(
            inject=f'if {inject}: raise torch.OutOfMemoryError("simulated: CUDA out of memory")',
            steps=6,
            out=os.path.join(work, "oom-" + str(replans)),
            done_outcome="ok",
        )
        ran = python(code, timeout=180)
        outcome, detail = snippet_outcome(ran)
        if outcome == "ok" and f"{replans} re-plans" not in detail:
            outcome = "silent wrong"
        expected = "saved, re-planned, run continues" if replans else "evaluated in pieces, run continues"
        cases.append(Case(name, expected, outcome, detail, ran.seconds, "training"))
    return cases


def skipped_windows_case(work: str) -> Case:
    code = TRAIN_IN_PROCESS.format(
        inject="return original(self, *args, **kwargs) * float('nan')",
        steps=25,
        out=os.path.join(work, "nan"),
        done_outcome="silent wrong",
    )
    ran = python(code, timeout=240)
    outcome, detail = snippet_outcome(ran)
    return Case(
        "every window skipped (non-finite)",
        "clear error after K windows",
        outcome,
        detail,
        ran.seconds,
        "training",
    )


# ----------------------------------------------------------------------------------------- kills
def model_tensors(path: str) -> dict[str, Any] | None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    return {"step": state.get("step"), "model": state.get("model"), "optimizer": state.get("optimizer")}


def same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def kill_case(
    work: str, index: int, reference: dict[str, Any], steps: int, when: tuple[int, float] | None
) -> Case:
    """kill -9 ``when`` = (after this many steps, this many seconds later), or (None) the moment a
    checkpoint's temporary file appears after the first checkpoint; then resume and compare."""
    out = os.path.join(work, f"kill{index}")
    argv = [
        sys.executable,
        "-m",
        "microbatch",
        "train",
        *TINY,
        "--steps",
        str(steps),
        "--checkpoint-interval",
        "1",
        "--out",
        out,
    ]
    process = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environment(), cwd=str(ROOT)
    )
    began = time.perf_counter()
    name = f"kill -9 {when[1]:.2f} s after step {when[0]}" if when else "kill -9 inside a checkpoint write"
    metrics = Path(out, "metrics.jsonl")
    reached: float | None = None  # when the run had done when[0] steps
    while process.poll() is None:
        elapsed = time.perf_counter() - began
        done = len(metrics.read_text().splitlines()) if when is not None and metrics.exists() else 0
        if when is not None and reached is None and done >= when[0]:
            reached = elapsed
        if when is not None and reached is not None and elapsed >= reached + when[1]:
            break
        # A write after the first: an earlier checkpoint exists, so the kill lands mid-run.
        if (
            when is None
            and Path(out, "checkpoint.pt").exists()
            and glob.glob(os.path.join(out, ".checkpoint*.tmp"))
        ):
            break
        if elapsed > 180:
            break
        time.sleep(0.0005 if when is None else 0.01)
    killed = process.poll() is None
    if killed:
        process.send_signal(signal.SIGKILL)
    process.wait()
    if not Path(out, "checkpoint.pt").exists():
        # Killed before the first checkpoint: nothing was saved yet, so nothing is lost; a new run starts.
        return Case(
            name,
            "resumes bitwise exactly",
            "ok",
            "killed before the first checkpoint",
            time.perf_counter() - began,
            "training",
        )
    ran = cli("train", "--resume", "--out", out, "--no-progress", timeout=180)
    final = model_tensors(os.path.join(out, "checkpoint.pt"))
    if ran.rc is None:
        outcome, detail = "hang", "resume"
    elif ran.rc != 0 or final is None:
        outcome, detail = (
            "data lost",
            f"resume exit {ran.rc}: {(ran.err.strip().splitlines() or [''])[-1][:120]}",
        )
    elif not same(final, reference):
        outcome, detail = (
            "silent wrong",
            f"resumed run differs from the uninterrupted one (step {final['step']})",
        )
    else:
        left = glob.glob(os.path.join(out, ".checkpoint.pt.*.tmp"))
        outcome, detail = (
            ("silent wrong", f"bitwise equal, but {len(left)} .tmp left") if left else ("ok", "bitwise equal")
        )
    detail += "" if killed else " (run ended before the kill)"
    return Case(name, "resumes bitwise exactly", outcome, detail, time.perf_counter() - began, "training")


def kill_cases(work: str, *, kills: int, write_kills: int, steps: int, seed: int) -> list[Case]:
    reference_dir = os.path.join(work, "reference")
    began = time.perf_counter()
    ran = train(reference_dir, "--steps", str(steps), "--checkpoint-interval", "1")
    wall = time.perf_counter() - began
    reference = model_tensors(os.path.join(reference_dir, "checkpoint.pt"))
    step_seconds = float(summary_of(reference_dir).get("seconds", 1.0)) / steps
    if ran.rc != 0 or reference is None:
        return [Case("reference run for kills", "finishes", "traceback", ran.err[-160:], wall, "training")]
    rng = random.Random(seed)
    # Random moments of the training itself: after 1 .. steps-1 steps, somewhere inside the next one
    # (every step ends with a checkpoint write, so some land inside one).
    moments: list[tuple[int, float] | None] = [
        (rng.randint(1, steps - 1), rng.uniform(0.0, step_seconds)) for _ in range(kills)
    ]
    moments += [None] * write_kills
    return [kill_case(work, i, reference, steps, when) for i, when in enumerate(moments)]


# ----------------------------------------------------------------------------------------- report
def section(report: dict[str, Any]) -> str:
    counts = Counter(case["outcome"] for case in report["cases"])
    rows = [
        [
            case["name"],
            case["expected"],
            case["outcome"],
            case["detail"][:90],
            f"{case['seconds']:.1f}",
            case["owner"],
        ]
        for case in report["cases"]
    ]
    totals = ", ".join(f"{counts.get(outcome, 0)} {outcome}" for outcome in OUTCOMES)
    return "\n".join(
        [
            report.get("intro", "Every fault of issue #11 injected (benchmarks/faults.py): what a user gets.")
            + " Target: "
            "0 traceback, 0 hang, 0 silent wrong, 0 data lost. owner: library = accumulation, planner, CLI; "
            "training = the training loop. launcher traceback: torchrun's own launcher re-raises the "
            "signal (SignalException, exit 1) after our workers saved and printed the resume command; "
            "not avoidable from the workers (README, torchrun paragraph).",
            "",
            f"Totals: {totals} ({len(report['cases'])} cases, {report['seconds']:.0f} s).",
            "",
            results.markdown_table(["case", "expected", "outcome", "detail", "s", "owner"], rows),
            "",
            results.environment_line(report["environment"])
            + " Measured while other jobs shared the machine; times are wall seconds per case, "
            "for scale only.",
            "",
            f"Reproduce: `{report['command']}`",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20, help="kill -9 at random moments (default 20)")
    parser.add_argument(
        "--write-kills", type=int, default=5, help="kill -9 inside checkpoint writes (default 5)"
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each killed run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--only",
        choices=("library", "cli", "kills", "runs", "edges"),
        help="run one group of cases (runs: issue 22's run folders and saved state; edges: issue 35's "
        "lock, folder, output, checksums, planning signals and torchrun restarts; each its own section)",
    )
    parser.add_argument("--quick", action="store_true", help="3 random kills and 1 in a checkpoint write")
    results.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.kills, args.write_kills = 3, 1
    began = time.perf_counter()
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="microbatch-faults-") as work:
        if args.only in (None, "library"):
            cases += library_cases()
        if args.only in (None, "cli"):
            cases += command_line_cases(work)
        if args.only in (None, "kills"):
            cases += kill_cases(
                work, kills=args.kills, write_kills=args.write_kills, steps=args.steps, seed=args.seed
            )
        if args.only in (None, "runs"):
            from _faults_runs import run_cases  # benchmarks/_faults_runs.py (imports this module)

            cases += run_cases(work)
        if args.only in (None, "edges"):
            from _faults_edges import edge_cases  # benchmarks/_faults_edges.py (imports this module)

            cases += edge_cases(work)
    for case in cases:
        print(f"{case.outcome:>12}  {case.name}: {case.detail}", file=sys.stderr)
    report: dict[str, Any] = {
        "cases": [asdict(case) for case in cases],
        "counts": dict(Counter(case.outcome for case in cases)),
        "seconds": time.perf_counter() - began,
        "environment": results.environment(),
    }
    report["command"] = results.reproducing_command(
        "faults", sys.argv[1:] if argv is None else list(argv), json_mode=args.json
    )
    title = {"runs": RUNS_SECTION_TITLE, "edges": EDGES_SECTION_TITLE}.get(args.only or "", SECTION_TITLE)
    if args.only == "runs":
        report["intro"] = (
            "Issue 22's faults (benchmarks/_faults_runs.py, `faults.py --only runs`): foreign and concurrent "
            "run folders, session signals, symlinks, edited plans / histories / checkpoints, stash files, "
            "huge sizes; owner runs = the run folder and saved state."
        )
    if args.only == "edges":
        report["intro"] = (
            "Issue 35's faults (benchmarks/_faults_edges.py, `faults.py --only edges`): the lock file "
            "deleted, the folder swapped for a link, output that fails, damaged checkpoints and histories, "
            "plans, signals while planning, ranks killed under torchrun; owner edges."
        )
    return results.emit(title, section(report), report, json_mode=args.json, write=not args.no_write)


if __name__ == "__main__":
    sys.exit(main())
