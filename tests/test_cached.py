"""Gradient caching (mb.cached_backward) against the full-batch reference, in float64.

Tolerance: rtol 1e-10, atol 1e-13 on every parameter's gradient (towers and the loss's learned
temperature). The cached form computes the same sums in another order (per micro-batch, then
accumulated into .grad), which costs a few ulps; plain accumulation of the same coupled loss is
wrong by more than 10% of the largest gradient entry (asserted), so the tolerance separates the two
by eight orders of magnitude.
"""

from __future__ import annotations

import pytest
import torch

import microbatch as mb
import microbatch.accumulate.cached
from dual_encoder import grads, make_batch, make_models, relative_error
from microbatch.errors import ConfigError, UsageError

TOL = {"rtol": 1e-10, "atol": 1e-13}
BATCH = 32


def full_batch_grads(encoder, loss_fn, batch) -> tuple[dict[str, torch.Tensor], float]:
    loss = loss_fn(encoder.encode(batch))
    loss.backward()
    result = grads(encoder, loss_fn)
    encoder.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    return result, float(loss.detach())


def cached_grads(encoder, loss_fn, batch, micro: int) -> tuple[dict[str, torch.Tensor], float]:
    loss = mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=micro)
    assert not loss.requires_grad
    result = grads(encoder, loss_fn)
    encoder.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    return result, float(loss)


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("micro", [8, 5, 32, 1])
def test_dual_encoder_infonce_equals_full_batch(micro: int) -> None:
    encoder, loss_fn = make_models()
    batch = make_batch(BATCH, seed=1)
    expected, expected_loss = full_batch_grads(encoder, loss_fn, batch)
    actual, actual_loss = cached_grads(encoder, loss_fn, batch, micro)
    assert "1.log_scale" in actual  # the learned temperature got its gradient
    assert_grads_close(actual, expected)
    assert actual_loss == pytest.approx(expected_loss, rel=1e-12)


def test_plain_accumulation_of_the_same_loss_is_wrong() -> None:
    encoder, loss_fn = make_models()
    batch = make_batch(BATCH, seed=1)
    expected, _ = full_batch_grads(encoder, loss_fn, batch)
    for start in range(0, BATCH, 8):  # the usual recipe: mean loss per micro-batch, weighted 8/32
        micro = {k: v[start : start + 8] for k, v in batch.items()}
        (loss_fn(encoder.encode(micro)) * (8 / BATCH)).backward()
    plain = grads(encoder, loss_fn)
    assert relative_error(plain, expected) > 0.1  # each sample sees 7 negatives instead of 31


def reference_with_micro_batch_masks(
    encoder, loss_fn, batch, micro: int, seed: int
) -> dict[str, torch.Tensor]:
    """The full batch's gradient with the dropout masks drawn micro-batch by micro-batch from ``seed``."""
    torch.manual_seed(seed)
    parts = [encoder.encode({k: v[s : s + micro] for k, v in batch.items()}) for s in range(0, BATCH, micro)]
    representations = tuple(torch.cat(tower) for tower in zip(*parts, strict=True))
    loss_fn(representations).backward()
    result = grads(encoder, loss_fn)
    encoder.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    return result


@pytest.mark.parametrize("micro", [8, 5])
def test_dropout_is_replayed(micro: int) -> None:
    encoder, loss_fn = make_models(dropout=0.3)
    batch = make_batch(BATCH, seed=2)
    expected = reference_with_micro_batch_masks(encoder, loss_fn, batch, micro, seed=7)
    after_reference = torch.rand(3)
    torch.manual_seed(7)
    actual, _ = cached_grads(encoder, loss_fn, batch, micro)
    assert_grads_close(actual, expected)
    # The replay leaves the caller's RNG stream where one forward pass over the batch leaves it.
    torch.testing.assert_close(torch.rand(3), after_reference, rtol=0, atol=0)
    # Dropout matters here: other masks give a visibly different gradient.
    other_masks = reference_with_micro_batch_masks(encoder, loss_fn, batch, micro, seed=8)
    assert relative_error(other_masks, expected) > 1e-2


def test_dict_representations_and_shared_encoder() -> None:
    # One shared tower encodes both views (SimCLR-style); encode returns a dict.
    encoder, loss_fn = make_models()
    tower = encoder.image

    def encode(micro):
        return {"a": tower(micro["image"]), "b": tower(micro["image"].flip(-1))}

    def loss(reps):
        return loss_fn((reps["a"], reps["b"]))

    batch = make_batch(BATCH, seed=3)
    loss(encode(batch)).backward()
    expected = grads(tower, loss_fn)
    tower.zero_grad(set_to_none=True)
    loss_fn.zero_grad(set_to_none=True)
    mb.cached_backward(encode, batch, loss, micro_batch_size=6)
    assert_grads_close(grads(tower, loss_fn), expected)


def test_checkpointing_inside_encode() -> None:
    encoder, loss_fn = make_models(dropout=0.2, depth=3)
    batch = make_batch(BATCH, seed=4)
    expected = reference_with_micro_batch_masks(encoder, loss_fn, batch, 8, seed=11)
    handles = [mb.checkpoint(encoder.image), mb.checkpoint(encoder.text)]
    torch.manual_seed(11)
    actual, _ = cached_grads(encoder, loss_fn, batch, 8)
    for handle in handles:
        handle.remove()
    assert_grads_close(actual, expected)


def test_saved_activations_peak_is_one_micro_batch() -> None:
    # Wide towers: activations (32 x 256 per layer) dwarf the representations (32 x 8). Gradients
    # exist before each measured span (a later training step), so the peaks differ only by
    # activations, temporaries and the representation cache. Measured: saved activations at the peak
    # 1054208 B (full batch), 267776 B (one micro-batch of 8), 267776 B (cached, micro-batches of 8).
    encoder, loss_fn = make_models(width=256, depth=4)
    batch = make_batch(BATCH, seed=5)
    loss_fn(encoder.encode(batch)).backward()
    runs = {
        "full": lambda: loss_fn(encoder.encode(batch)).backward(),
        "micro": lambda: loss_fn(encoder.encode({k: v[:8] for k, v in batch.items()})).backward(),
        "cached": lambda: mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=8),
    }
    saved, above_weights = {}, {}
    for name, run in runs.items():
        with mb.MemoryTracker("cpu", model=encoder) as tracker:
            run()
        saved[name] = tracker.breakdown["saved activations"]
        above_weights[name] = (
            tracker.peak_bytes - tracker.breakdown["parameters"] - tracker.breakdown["gradients"]
        )
    representation_bytes = 2 * BATCH * 8 * 8  # two towers, 32 x 8 float64
    similarity_bytes = BATCH * BATCH * 8
    # Cached: one micro-batch's activations plus the representations (values and gradient) and the loss's.
    assert saved["cached"] <= saved["micro"] + 2 * representation_bytes + 4 * similarity_bytes
    assert above_weights["cached"] <= above_weights["micro"] + 2 * representation_bytes + 4 * similarity_bytes
    assert saved["cached"] < 0.3 * saved["full"]
    assert above_weights["cached"] < 0.6 * above_weights["full"]


def test_bad_input_raises_clear_errors() -> None:
    encoder, loss_fn = make_models()
    batch = make_batch(8, seed=6)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=0)
    with pytest.raises(ConfigError, match="one row per sample"):
        mb.cached_backward(lambda m: encoder.image(m["image"]).sum(0), batch, loss_fn, micro_batch_size=4)
    with pytest.raises(ConfigError, match="scalar"):
        mb.cached_backward(encoder.encode, batch, lambda r: r[0] @ r[1].T, micro_batch_size=4)
    with pytest.raises(ConfigError, match="must return the representations"):
        mb.cached_backward(lambda m: 3, batch, loss_fn, micro_batch_size=4)
    with pytest.raises(ConfigError, match="does not require grad"):
        mb.cached_backward(encoder.encode, batch, lambda r: torch.zeros(()), micro_batch_size=4)
    with torch.no_grad(), pytest.raises(UsageError, match="no_grad"):
        mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=4)
    shapes = iter([(8, 4), (8, 5)])

    def inconsistent(micro):
        return encoder.image(micro["image"])[:, : next(shapes)[1]]

    with pytest.raises(ConfigError, match="same structure"):
        mb.cached_backward(inconsistent, make_batch(16, seed=6), lambda r: r.sum(), micro_batch_size=8)
    calls = iter([8, 4])

    def changes_on_replay(micro):
        return encoder.image(micro["image"])[:, : next(calls)]

    with pytest.raises(UsageError, match="deterministic"):
        mb.cached_backward(changes_on_replay, batch, lambda r: r.sum(), micro_batch_size=8)


def test_accumulator_window_of_cached_batches_equals_full_step() -> None:
    # A window of three contrastive batches (32, 32, 20): GradScaler unscales, clipping and the
    # scheduler act once; the step equals one step on the window's sample-weighted mean loss.
    sizes, seeds = [32, 32, 20], [31, 32, 33]
    batches = [make_batch(n, seed=s) for n, s in zip(sizes, seeds, strict=True)]
    encoder, loss_fn = make_models()
    params = [*encoder.parameters(), *loss_fn.parameters()]
    window_loss = sum(loss_fn(encoder.encode(b)) * n for b, n in zip(batches, sizes, strict=True)) / sum(
        sizes
    )
    window_loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
    with torch.no_grad():
        for p in params:
            p -= 0.3 * p.grad
    expected = [p.detach().clone() for p in params]

    encoder, loss_fn = make_models()
    model = torch.nn.ModuleDict({"encoder": encoder, "loss": loss_fn})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    acc = mb.Accumulator(model, optimizer, steps=3, max_grad_norm=0.1, scheduler=scheduler, scaler=scaler)
    stats = []
    for micro in acc.iterate(batches):
        mb.cached_backward(encoder.encode, micro.batch, loss_fn, micro_batch_size=8, accumulator=acc)
        if micro.is_last:
            stats.append(acc.step())
    assert len(stats) == 1 and stats[0].items == sum(sizes)
    assert stats[0].loss == pytest.approx(float(window_loss.detach()), rel=1e-12)
    assert stats[0].grad_norm == pytest.approx(float(norm), rel=1e-10) and stats[0].grad_norm > 0.1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.15)  # the scheduler stepped once
    for actual, reference in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(actual.detach(), reference, **TOL)


def test_verify_recognises_the_coupled_loss_and_points_to_cached_backward() -> None:
    encoder, loss_fn = make_models()
    model = torch.nn.ModuleDict({"encoder": encoder, "loss": loss_fn})

    def loss(model, batch):
        return model["loss"](model["encoder"].encode(batch)), batch["image"].shape[0]

    workload = mb.Workload(model=model, make_batch=lambda b: make_batch(b, seed=9), loss=loss, name="clip")
    report = mb.verify(workload, batch=16, steps=4)
    assert not report.equivalent
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "coupled"]
    assert "cached_backward" in diagnostic.message
    batch = make_batch(16, seed=9)
    with torch.no_grad():
        full = float(loss_fn(encoder.encode(batch)))
        micro = sum(
            float(loss_fn(encoder.encode({k: v[s : s + 4] for k, v in batch.items()})))
            for s in range(0, 16, 4)
        )
    assert diagnostic.details["full_loss"] == pytest.approx(full, rel=1e-12)
    assert diagnostic.details["micro_batch_weighted_loss"] == pytest.approx(micro / 4, rel=1e-12)
    assert diagnostic.details["loss_rel_diff"] > 0.1


def test_distributed_and_accumulator_arguments_are_checked() -> None:
    encoder, loss_fn = make_models()
    batch = make_batch(8, seed=6)
    with pytest.raises(ConfigError, match="gather=True needs an initialised"):
        mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=4, gather=True)
    with pytest.raises(ConfigError, match=r"accumulator must be a microbatch\.Accumulator"):
        mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=4, accumulator=object())
    acc = mb.Accumulator(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="different models"):
        mb.cached_backward(encoder.encode, batch, loss_fn, micro_batch_size=4, accumulator=acc, model=loss_fn)


def test_a_second_backward_over_the_cached_loss_is_a_clear_error() -> None:
    torch.manual_seed(0)
    encoder, loss_fn = make_models()
    batch = make_batch(12, seed=1)
    loss = microbatch.accumulate.cached.cached_loss(encoder.encode, batch, loss_fn, micro_batch_size=4)
    loss.backward(retain_graph=True)  # replays the micro-batches and frees them
    with pytest.raises(UsageError, match="backpropagated twice"):
        loss.backward()
