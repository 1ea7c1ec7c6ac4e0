"""Faults in a window's life (issue 22): misuse caught at the call, one optimizer step per window.

Library cases for benchmarks/faults.py, in its snippet form: each runs in a fresh interpreter
after faults.py's LIBRARY_PRELUDE (x, y: 12 rows of float64 data; reference(model): the full
batch's gradient; close(a, b): rtol 1e-10, atol 1e-12) and prints ``OUTCOME|detail`` last.
``python benchmarks/faults_window.py`` runs only these and prints their table.
"""

from __future__ import annotations

WINDOW_CASES: dict[str, tuple[str, str]] = {
    "double loss scaling (scaler.scale(loss) and scaler=)": (
        "clear error at backward(), nothing accumulated",
        """
        model = nn.Linear(5, 1).double(); scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, scaler=scaler)
        try:
            acc.backward(scaler.scale(nn.functional.mse_loss(model(x), y)), items=12)
            verdict("silent wrong", "accepted: the gradient is scaled twice")
        except mb.ConfigError as e:
            verdict("clear error" if model.weight.grad is None else "silent wrong", str(e)[:120])
        """,
    ),
    "scheduler raises in step(), retry": (
        "ok: one optimizer step, the retry runs only the scheduler",
        """
        class Sched:
            left, steps = 1, 0
            def step(self):
                if self.left: self.left -= 1; raise RuntimeError("scheduler failed")
                self.steps += 1
        model = nn.Linear(5, 1).double(); expected = reference(model)
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.5); taken = []
        opt.register_step_post_hook(lambda *_: taken.append(1)); sched = Sched()
        acc = mb.Accumulator(model, opt, steps=3, scheduler=sched)
        for i in range(3):
            acc.backward(nn.functional.mse_loss(model(x[4*i:4*i+4]), y[4*i:4*i+4]), items=4)
        try:
            acc.step()
        except RuntimeError:
            pass
        acc.step()
        want = [s - 0.5 * g for s, g in zip(start, expected)]
        good = len(taken) == 1 and sched.steps == 1 and close(list(model.parameters()), want)
        detail = f"optimizer steps {len(taken)}, scheduler steps {sched.steps}"
        verdict("ok" if good else "silent wrong", detail)
        """,
    ),
    "optimizer OOM after changing parameters, retry": (
        "clear error: step() refuses the retry (the step is half made)",
        """
        class Half(torch.optim.SGD):
            left = 1
            @torch.no_grad()
            def step(self, closure=None):
                if self.left:
                    self.left -= 1; p = self.param_groups[0]["params"][0]; p.sub_(p.grad)
                    raise torch.OutOfMemoryError("CUDA out of memory")
                return super().step(closure)
        model = nn.Linear(5, 1).double()
        acc = mb.Accumulator(model, Half(model.parameters(), lr=0.1), steps=1)
        acc.backward(nn.functional.mse_loss(model(x), y), items=12)
        try:
            acc.step()
        except torch.OutOfMemoryError:
            pass
        try:
            acc.step(); verdict("silent wrong", "retried: part of the step applied twice")
        except mb.UsageError as e:
            verdict("clear error" if acc.step_began else "silent wrong", str(e)[:120])
        """,
    ),
    "Accumulator.load_state_dict: window -5, NaN, '3'": (
        "clear error naming 'window'",
        """
        model = nn.Linear(5, 1); acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
        refused = []
        for value in (-5, math.nan, "3"):
            try:
                acc.load_state_dict({"version": 1, "window": value})
            except mb.ConfigError as e:
                refused.append("'window'" in str(e))
        verdict("clear error" if refused == [True] * 3 and acc.window == 0 else "silent wrong", f"{refused}")
        """,
    ),
    "accumulate_dtype: a window discarded by the item check": (
        "ok: the next window's gradient is that window's alone (bitwise)",
        """
        base = nn.Linear(5, 1).to(torch.bfloat16); xb, yb = x.bfloat16(), y.bfloat16()
        def grads(bad_first):
            model = copy.deepcopy(base); opt = torch.optim.SGD(model.parameters(), lr=0.0); seen = []
            opt.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in model.parameters()]))
            acc = mb.Accumulator(model, opt, steps=2, accumulate_dtype=torch.float32)
            if bad_first:
                acc.backward(nn.functional.mse_loss(model(xb * 3), yb), items=torch.tensor(6))
                acc.backward(nn.functional.mse_loss(model(xb), yb), items=torch.tensor(-6))
                try:
                    acc.step()
                except mb.ConfigError:
                    pass
            for i in range(2):
                acc.backward(nn.functional.mse_loss(model(xb[6*i:6*i+6]), yb[6*i:6*i+6]), items=6)
            acc.step(); return seen[-1]
        alone, after = grads(False), grads(True)
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(alone, after))
        verdict("ok" if diff == 0 else "silent wrong", f"max difference {diff:g}")
        """,
    ),
    "two Accumulators on one model, one with accumulate_dtype": (
        "clear error until the first is closed (acc.close() / plan.remove)",
        """
        model = nn.Linear(5, 1).to(torch.bfloat16)
        wide = lambda: mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      accumulate_dtype=torch.float32)
        first = wide()
        try:
            wide()
            verdict("silent wrong", "a second one built: it would step nothing")
        except mb.UsageError as e:
            first.close()
            wide()
            verdict("clear error", str(e)[:120])
        """,
    ),
    "step(partial=True) inside iterate(); a nested iterate()": (
        "clear error for both",
        """
        model = nn.Linear(5, 1).double()
        acc = mb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
        data = [(x[4*i:4*i+4], y[4*i:4*i+4]) for i in range(3)]; refused = []
        for m in acc.iterate(data):
            acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
            if m.index == 0:
                for call in (lambda: acc.step(partial=True), lambda: next(iter(acc.iterate(data)))):
                    try:
                        call(); refused.append(False)
                    except mb.UsageError:
                        refused.append(True)
            if m.is_last:
                stats = acc.step()
        good = refused == [True, True] and stats.micro_batches == 3
        verdict("clear error" if good else "silent wrong", f"refused {refused}")
        """,
    ),
    "plan.apply fed DataLoader(batch_size=plan.micro_batch_size), 19 x 6 + 14": (
        "ok: trains as fed, with one warning naming plan.micro_batch_sizes",
        """
        records = []
        class Keep(logging.Handler):
            def emit(self, record): records.append(record.getMessage())
        logging.getLogger("microbatch").addHandler(Keep())
        plan = mb.Plan.manual(batch_size=128, micro_batch_size=19)
        model = nn.Linear(5, 1).double(); acc = plan.apply(model, torch.optim.SGD(model.parameters(), lr=0.0))
        rows = 2 * 133
        data = torch.utils.data.TensorDataset(torch.randn(rows, 5).double(), torch.randn(rows, 1).double())
        for m in acc.iterate(torch.utils.data.DataLoader(data, batch_size=plan.micro_batch_size)):
            acc.backward(nn.functional.mse_loss(model(m.batch[0]), m.batch[1]))
            if m.is_last: acc.step()
        warned = [r for r in records if "plan.micro_batch_sizes" in r]
        verdict("ok" if len(warned) == 1 else "silent wrong", (warned or ["no warning"])[0][:120])
        """,
    ),
    "microbatch train: OOM inside the optimizer's step (step 2)": (
        "clear error, no re-run, the step-1 checkpoint untouched",
        """
        import tempfile, os
        from microbatch.training import TrainConfig, load_checkpoint, train
        Real = torch.optim.AdamW
        class Fails(Real):
            taken = 0
            def step(self, closure=None):
                out = super().step(closure); type(self).taken += 1
                if type(self).taken == 2: raise torch.OutOfMemoryError("CUDA out of memory")
                return out
        torch.optim.AdamW = Fails
        out = os.path.join(tempfile.mkdtemp(), "run")
        config = TrainConfig(model="gpt-nano", batch=8, micro_batch=2, steps=3, eval_interval=100,
                             checkpoint_interval=1, out=out)
        try:
            train(config); verdict("silent wrong", "the run went on")
        except mb.MicrobatchError as e:
            step = load_checkpoint(os.path.join(out, "checkpoint.pt"))["step"]
            good = Fails.taken == 2 and step == 1
            detail = f"optimizer steps {Fails.taken}, checkpoint at {step}: {str(e)[:80]}"
            verdict("clear error" if good else "silent wrong", detail)
        """,
    ),
}


if __name__ == "__main__":
    import sys
    import textwrap

    import faults

    for name, (expected, code) in WINDOW_CASES.items():
        ran = faults.python(faults.LIBRARY_PRELUDE + textwrap.dedent(code), timeout=180)
        outcome, detail = faults.snippet_outcome(ran)
        print(f"| {name} | {expected} | {outcome} | {detail} | {ran.seconds:.1f} s |")
    sys.exit(0)
