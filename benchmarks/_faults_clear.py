"""Issue 35's clear words (item 10): each refusal says what is true and names the fix.

Imported by _faults_edges.py (``python benchmarks/faults.py --only edges``). A case is ``clear error``
when the words hold (one line, exit 2, the named fix works where one is named), ``unclear`` when they
do not, ``traceback`` / ``silent wrong`` as faults.py judges.
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import faults
from faults import Case, Ran, cli, judged, python, snippet_outcome

OWNER = "edges"
SIZE = r"[\d.,e+]+ (?:B|KiB|MiB|GiB)"


def _case(cases: list[Case], name: str, expected: str, check: Callable[[], tuple[str, str]]) -> None:
    began = time.perf_counter()
    try:
        outcome, detail = check()
    except Exception as error:  # the harness's own failure is reported, not hidden
        outcome, detail = "traceback", f"harness: {type(error).__name__}: {error}"[:160]
    cases.append(Case(name, expected, outcome, detail[:160], time.perf_counter() - began, OWNER))


def _refused(ran: Ran) -> tuple[str, str]:
    outcome, detail = judged(ran, ok=lambda r: False)
    if "This is a bug" in ran.err or "internal error" in ran.err:
        return "unclear", detail
    return outcome, detail


def _one_minimum(memory: str, *, fits: bool) -> tuple[str, str]:
    """gpt-nano on 2 ranks (DDP's buckets outside the model): one minimum, the budget as given; with
    ``fits`` the minimum, given back as it reads, plans."""
    args = ("plan", "gpt-nano", "--batch", "8", "--world-size", "2", "--no-progress")
    ran = cli(*args, "--memory", memory, timeout=300)
    outcome, detail = _refused(ran)
    if outcome != "clear error":
        return outcome, detail
    line = ran.err.strip().splitlines()[-1]
    named = set(re.findall(rf"at least ({SIZE})", line))
    given = re.sub(r"(\d)([KMG]iB)", r"\1 \2", memory)
    if len(named) != 1 or f"memory={given}" not in line:
        return "unclear", f"minimums {sorted(named)}; budget {given} named: {f'memory={given}' in line}"
    (minimum,) = named
    if not fits:
        sound = "not measured" in line and "refused before profiling" in line
        return ("clear error", f"one lower bound, {minimum}, said why") if sound else ("unclear", line)
    again = cli(*args, "--memory", minimum.replace(" ", ""), timeout=300)
    if again.rc != 0:
        return "unclear", f"{minimum} given back: exit {again.rc}: {again.err.strip()[-100:]}"
    return "clear error", f"one minimum, {minimum}; given back it plans"


SNIPPETS = {
    "mb.plan: the user's loss raises at micro-batch 4": (
        "the user's type, a note naming the call and the size",
        """
        import microbatch as mb
        from microbatch.workload import seed_linear
        w = seed_linear(); inner = w.loss
        def loss(model, batch):
            if len(batch[0]) == 4: raise KeyError("label 7")
            return inner(model, batch)
        w.loss = loss
        try:
            mb.plan(w, batch=8, memory="64MiB"); print("silent wrong|planned")
        except KeyError as e:
            note = " ".join(getattr(e, "__notes__", []))
            good = "loss(model, batch)" in note and "micro-batch of 4 samples" in note
            print(("clear error|" if good else "unclear|no context: ") + (note or repr(e))[:140])
        """,
    ),
    "split_by_tokens with max_tokens=10**17": (
        "one micro-batch (no budget binds), or a ConfigError naming the argument",
        """
        import microbatch as mb
        from microbatch.errors import ConfigError
        try:
            groups = mb.split_by_tokens([5] * 1000, 10**17)
            good = groups == [list(range(1000))]
            print(("ok|" if good else "silent wrong|") + f"{len(groups)} micro-batch(es) for 5000 tokens")
        except ConfigError as e: print("clear error|" + str(e)[:140])
        """,
    ),
    "plan file: one bit flipped, still a valid plan": (
        "refused by its checksum, naming the file",
        """
        import os, tempfile
        from microbatch.errors import ConfigError
        from microbatch.planner import Plan
        path = os.path.join(tempfile.mkdtemp(), "plan.json")
        Plan.manual(batch_size=12, micro_batch_size=4, parameters=20).save(path)
        raw = bytearray(open(path, "rb").read()); raw[raw.index(b'"parameters": 20') + 14] ^= 1  # 20 -> 30
        open(path, "wb").write(bytes(raw))
        try: Plan.load(path); print("silent wrong|loaded a changed plan")
        except ConfigError as e:
            good = path in str(e) and "checksum" in str(e)
            print(("clear error|" if good else "unclear|") + str(e)[:140])
        """,
    ),
}


def _verify_advice() -> tuple[str, str]:
    """verify on a workload whose micro-batches differ in tokens: advice in the workload's terms."""
    ran = cli("verify", "lm-varlen", "--batch", "16", "--steps", "4", timeout=300)
    outcome, detail = judged(ran, ok=lambda r: r.rc == 0)
    advice = [line for line in ran.out.splitlines() if "item-counts" in line]
    if outcome != "ok":
        return outcome, detail
    if not advice:
        return "unclear", "no item-counts line"
    if "backward(" in advice[0] or "(loss, items)" not in advice[0]:
        return "unclear", advice[0][-150:]
    return "ok", "advice names what the workload's loss returns"


def _capped(work: str, *args: str) -> tuple[str, str]:
    """``microbatch ARGS`` under an address-space cap (ulimit -v) 1.5 GiB above what importing
    torch and microbatch takes: the batch asked for cannot be allocated."""
    probe = (
        "import os, torch, microbatch; "
        "print(int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE'))"
    )
    imported = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=faults.environment()
    )
    cap = int(imported.stdout.split()[-1]) + 1536 * 2**20

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    ran = subprocess.run(
        [sys.executable, "-m", "microbatch", *args],
        capture_output=True, text=True, env=faults.environment(), cwd=work, preexec_fn=limit, timeout=300,
    )  # fmt: skip
    outcome, detail = _refused(Ran(ran.returncode, ran.stdout, ran.stderr, 0.0))
    if outcome == "clear error" and "host ran out of memory" not in detail:
        return "unclear", detail
    return outcome, detail


def clear_cases(work: str, cases: list[Case]) -> None:
    for name, args in (
        ("verify --batch 2*10^8 under ulimit -v", ("verify", "gpt-nano", "--batch", str(2 * 10**8))),
        (
            "train --batch 2*10^7 under ulimit -v",
            ("train", "--model", "gpt-nano", "--batch", str(2 * 10**7), "--micro-batch", "1000",
             "--steps", "1", "--no-progress", "--out", "capped-run"),
        ),
    ):  # fmt: skip
        _case(cases, name, "host memory named, lower --batch", lambda args=args: _capped(work, *args))
    name = "verify: micro-batches with different token counts"
    _case(cases, name, "advice fits the workload", _verify_advice)
    for name, (expected, code) in SNIPPETS.items():
        _case(cases, name, expected, lambda code=code: snippet_outcome(python(code)))
    _case(
        cases,
        "budget refused (DDP buckets outside the model)",
        "one minimum, fits when given back",
        lambda: _one_minimum("700KiB", fits=True),
    )
    _case(
        cases,
        "budget below the weights (DDP buckets outside the model)",
        "one lower bound, said why",
        lambda: _one_minimum("600KiB", fits=False),
    )
