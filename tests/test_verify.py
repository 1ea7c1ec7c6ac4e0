"""mb.verify and ``microbatch verify`` against full-batch references computed here.

Tolerances: float64 comparisons of gradients use rtol 1e-10 / atol 1e-12 (summation order is the
only difference); reported numbers are checked against the same numbers recomputed in the test
(rel 1e-6, they come from identical arithmetic up to summation order). The seed example in float32
uses atol 1e-6, as the seed documents do.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from equivalence import full_batch_grads, grads_of
from microbatch.cli import main
from microbatch.errors import ConfigError, WorkloadError
from microbatch.trees.batches import split_batch
from microbatch.verification.check import VerifyReport, verify
from microbatch.workload import Workload, load_workload

VOCAB = 13


# ---------------------------------------------------------------------- test-local workloads


class TinyLM(nn.Module):
    def __init__(self, *, dropout: float = 0.0, functional_dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.drop = nn.Dropout(dropout)
        self.functional_dropout = functional_dropout
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.drop(torch.tanh(self.mix(self.embed(tokens))))
        hidden = F.dropout(hidden, self.functional_dropout, self.training)
        return self.head(hidden)


def padded_tokens(batch_size: int, *, seed: int = 0, length: int = 10) -> dict[str, torch.Tensor]:
    """Sequences of very different lengths; padding positions carry label -100."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, length), generator=g)
    labels = torch.randint(0, VOCAB, (batch_size, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch_size,), generator=g)
    lengths[: batch_size // 4] = 1
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
    return {"tokens": tokens, "labels": labels}


def token_mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return loss, (batch["labels"] != -100).sum()


def token_mean_counted_as_samples(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The mistake: a token mean, reported as a mean over samples."""
    return token_mean_loss(model, batch)[0], batch["tokens"].shape[0]


def token_sum_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss, items = token_mean_loss(model, batch)
    return loss * items, items


def lm_workload(**model_options: float) -> Workload:
    torch.manual_seed(1)
    return Workload(
        model=TinyLM(**model_options).double(),
        make_batch=lambda b: padded_tokens(b),
        loss=token_mean_loss,
        name="tiny-lm",
    )


def token_workload_samples() -> Workload:
    """Loaded by the CLI as 'test_verify:token_workload_samples'."""
    workload = lm_workload()
    workload.loss = token_mean_counted_as_samples
    return workload


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    x, y = batch
    return F.mse_loss(model(x), y), x.shape[0]


def regression_batch(b: int, features: int = 6, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, features, generator=g, dtype=torch.float64), torch.randn(
        b, 2, generator=g, dtype=torch.float64
    )


def bn_workload() -> Workload:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 2)).double()
    return Workload(model=model, make_batch=regression_batch, loss=mse, name="tiny-bn")


class NoisyInput(nn.Module):
    """Random in every mode: noise added to the input by torch.rand, not by a dropout module."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * (1 + torch.rand_like(x)))


class Centering(nn.Module):
    """Samples interact: every output is centred on the batch mean (no BatchNorm involved)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.layer(x))
        return self.out(hidden - hidden.mean(0, keepdim=True))


def run_json(argv: list[str], capsys) -> tuple[int, dict]:
    code = main(["verify", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def reference_grads(model: nn.Module, loss_fn, micro: list) -> tuple[dict, dict, dict]:
    """Full-batch gradient, exactly weighted accumulation, and the divide-by-steps recipe, by hand."""
    full = copy.deepcopy(model)
    batch = (
        {key: torch.cat([m[key] for m in micro]) for key in micro[0]} if isinstance(micro[0], dict) else None
    )
    if batch is None:
        batch = tuple(torch.cat([m[i] for m in micro]) for i in range(len(micro[0])))
    loss_fn(full, batch)[0].backward()
    weighted, naive = copy.deepcopy(model), copy.deepcopy(model)
    counts = [float(loss_fn(copy.deepcopy(model), m)[1]) for m in micro]
    for piece, count in zip(micro, counts, strict=True):
        (loss_fn(weighted, piece)[0] * count / sum(counts)).backward()
        (loss_fn(naive, piece)[0] / len(micro)).backward()
    return grads_of(full), grads_of(weighted), grads_of(naive)


def max_abs(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def max_rel(a: dict, b: dict) -> float:
    return max_abs(a, b) / max(float(b[n].abs().max()) for n in b)


# ---------------------------------------------------------------------- the seed example


def test_seed_linear_matches_full_batch_and_the_cli_prints_it(capsys) -> None:
    workload = load_workload("seed-linear")
    x, y = workload.make_batch(32)
    expected, _ = full_batch_grads(workload.model, mse, (x, y))
    # The seed documents' loop: four micro-batches of 8, each loss divided by 4.
    seed_model = copy.deepcopy(workload.model)
    for x_micro, y_micro in zip(x.chunk(4), y.chunk(4), strict=True):
        (F.mse_loss(seed_model(x_micro), y_micro) / 4).backward()
    seed_diff = max_abs(grads_of(seed_model), expected)
    assert seed_diff <= 1e-6

    code, report = run_json(["seed-linear", "--batch", "32", "--steps", "4"], capsys)
    assert code == 0
    assert report["equivalent"] is True and report["micro_batch_sizes"] == [8, 8, 8, 8]
    assert report["max_abs_diff"] <= 1e-6
    assert report["max_abs_diff"] == pytest.approx(seed_diff, rel=1e-6, abs=1e-12)
    assert {p["name"] for p in report["parameters"]} == {"weight", "bias"}

    assert main(["verify", "seed-linear"]) == 0
    text = capsys.readouterr().out
    assert "batch 32 as 4 micro-batches of 8" in text
    assert f"{report['max_abs_diff']:.2e}" in text and "EQUAL within rounding" in text


# ---------------------------------------------------------------------- token-level losses


def test_token_mean_loss_exact_with_items_and_recipe_gap_reported() -> None:
    workload = lm_workload()
    report = verify(workload, batch=16, steps=4)
    micro = split_batch(padded_tokens(16), [4, 4, 4, 4])
    full, weighted, naive = reference_grads(workload.model, token_mean_loss, micro)
    for name in full:  # the test's own exact accumulation is the full batch
        torch.testing.assert_close(weighted[name], full[name], rtol=1e-10, atol=1e-12)
    assert report.equivalent and report.dtype == "float64" and report.rtol == 1e-10
    assert report.max_rel_diff <= 1e-10
    assert report.naive_max_rel_diff == pytest.approx(max_rel(naive, full), rel=1e-6)
    assert report.naive_max_rel_diff > 1e-2
    assert list(report.items) == [int((m["labels"] != -100).sum()) for m in micro]
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "item-counts"]
    assert diagnostic.severity == "info" and "tokens" in diagnostic.message
    # verify was given a workload: the advice is in its terms (what the loss returns), never a call to
    # Accumulator.backward the user does not make (issue 35)
    assert "loss(model, batch) -> (loss, items)" in diagnostic.message
    assert "backward(" not in diagnostic.message
    assert report.accumulated_loss == pytest.approx(report.full_loss, rel=1e-12)


def test_lm_varlen_builtin_through_the_cli(capsys) -> None:
    code, report = run_json(["lm-varlen", "--batch", "16", "--steps", "4", "--dtype", "float64"], capsys)
    workload = load_workload("lm-varlen")  # a fresh workload: the same first batch
    workload.model.double()
    batch = workload.make_batch(16)
    full, _, naive = reference_grads(workload.model, workload.loss, split_batch(batch, [4] * 4))
    assert code == 0 and report["equivalent"]
    assert report["max_rel_diff"] <= 1e-10
    assert report["naive_max_rel_diff"] == pytest.approx(max_rel(naive, full), rel=1e-6)
    assert report["naive_max_rel_diff"] > 1e-3
    assert [d["kind"] for d in report["diagnostics"]] == ["item-counts"]


def test_loss_that_miscounts_its_items_is_recognised(capsys) -> None:
    code, report = run_json(["test_verify:token_workload_samples", "--batch", "16", "--steps", "4"], capsys)
    micro = split_batch(padded_tokens(16), [4, 4, 4, 4])
    tokens = [int((m["labels"] != -100).sum()) for m in micro]
    full, _, naive = reference_grads(lm_workload().model, token_mean_loss, micro)
    assert code == 1 and not report["equivalent"]
    # Reported items are samples, so microbatch weighs micro-batches equally: the recipe's error.
    assert report["max_rel_diff"] == pytest.approx(max_rel(naive, full), rel=1e-6)
    (diagnostic,) = [d for d in report["diagnostics"] if d["kind"] == "items-mismatch"]
    assert diagnostic["details"]["fitted_weights"] == pytest.approx(
        [t / sum(tokens) for t in tokens], abs=1e-8
    )
    assert diagnostic["details"]["matches"][0] == "entries != -100 of batch['labels']"
    assert "labels != -100" in diagnostic["message"]
    assert "loss(model, batch) -> (loss, count)" in diagnostic["message"]
    assert all("backward(" not in d["message"] for d in report["diagnostics"])


def test_summed_loss_is_recognised() -> None:
    workload = lm_workload()
    workload.loss = token_sum_loss
    report = verify(workload, batch=16, steps=4)
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "items-mismatch"]
    assert diagnostic.details["fitted_weights"] == pytest.approx([1.0] * 4, abs=1e-8)
    assert "not a mean" in diagnostic.message


# ---------------------------------------------------------------------- BatchNorm


def test_batchnorm_difference_reported_with_its_size() -> None:
    workload = bn_workload()
    report = verify(workload, batch=16, steps=4)
    micro = split_batch(regression_batch(16), [4, 4, 4, 4])
    full, weighted, _ = reference_grads(workload.model, mse, micro)
    expected_gap = max_rel(weighted, full)
    assert expected_gap > 1e-3  # BatchNorm on micro-batches of 4 really changes the gradient
    assert not report.equivalent
    assert report.max_rel_diff == pytest.approx(expected_gap, rel=1e-6)
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "batchnorm"]
    assert diagnostic.severity == "warning"
    assert diagnostic.details["max_rel_diff"] == pytest.approx(expected_gap, rel=1e-6)
    assert diagnostic.details["frozen_max_rel_diff"] <= 1e-10  # frozen BatchNorm: exact
    assert diagnostic.details["running_stats_max_abs_diff"] > 0
    assert (
        "convert_batchnorm_to_groupnorm" in diagnostic.message and f"{expected_gap:.2e}" in diagnostic.message
    )
    assert not any(d.kind == "unexplained" for d in report.diagnostics)


@pytest.mark.slow
def test_cnn_bn_builtin_through_the_cli(capsys) -> None:
    code, report = run_json(["cnn-bn", "--batch", "16", "--steps", "2", "--dtype", "float64"], capsys)
    workload = load_workload("cnn-bn")
    workload.model.double()
    images, labels = workload.make_batch(16)
    full, weighted, _ = reference_grads(
        workload.model, workload.loss, split_batch((images.double(), labels), [8, 8])
    )
    assert code == 1
    assert report["max_rel_diff"] == pytest.approx(max_rel(weighted, full), rel=1e-6)
    (diagnostic,) = [d for d in report["diagnostics"] if d["kind"] == "batchnorm"]
    assert len(diagnostic["details"]["layers"]) == 3
    assert diagnostic["details"]["frozen_max_rel_diff"] <= 1e-10
    assert diagnostic["details"]["max_rel_diff"] > 1e-3


# ---------------------------------------------------------------------- randomness


def test_dropout_modules_are_put_in_eval_mode_and_the_user_model_is_untouched() -> None:
    workload = lm_workload(dropout=0.3)
    before = copy.deepcopy(workload.model.state_dict())
    rng_before = torch.get_rng_state()
    report = verify(workload, batch=16, steps=4)
    assert "dropout module(s) put in eval mode" in report.randomness_control
    assert report.equivalent and report.max_rel_diff <= 1e-10
    assert [d.kind for d in report.diagnostics] == ["randomness", "item-counts"]
    # Reference: the same model with dropout off.
    reference = copy.deepcopy(workload.model).eval()
    micro = split_batch(padded_tokens(16), [4] * 4)
    full, _, naive = reference_grads(reference, token_mean_loss, micro)
    assert report.naive_max_rel_diff == pytest.approx(max_rel(naive, full), rel=1e-6)
    # Nothing of the user's changed: weights, gradients, modes, global RNG.
    assert workload.model.training and workload.model.drop.training
    assert all(p.grad is None for p in workload.model.parameters())
    for name, value in workload.model.state_dict().items():
        assert torch.equal(value, before[name])
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_functional_dropout_uses_eval_mode_except_batchnorm() -> None:
    workload = lm_workload(functional_dropout=0.3)
    report = verify(workload, batch=8, steps=2)
    assert "eval mode except its BatchNorm layers" in report.randomness_control
    assert report.equivalent and report.max_rel_diff <= 1e-10


def test_uncontrolled_randomness_reports_a_noise_floor() -> None:
    torch.manual_seed(4)
    workload = Workload(model=NoisyInput().double(), make_batch=regression_batch, loss=mse, name="noisy")
    report = verify(workload, batch=16, steps=4)
    (diagnostic,) = [d for d in report.diagnostics if d.kind == "randomness"]
    assert diagnostic.severity == "warning" and "noisy" in diagnostic.message
    # Reference noise: two full-batch gradients under different seeds, computed here.
    grads = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        grads.append(full_batch_grads(workload.model, mse, regression_batch(16))[0])
    assert diagnostic.details["noise_max_rel_diff"] == pytest.approx(max_rel(grads[1], grads[0]), rel=1e-6)
    assert diagnostic.details["noise_max_rel_diff"] > 1e-3


def test_interacting_samples_are_recognised_as_coupled() -> None:
    torch.manual_seed(5)
    workload = Workload(model=Centering().double(), make_batch=regression_batch, loss=mse, name="centering")
    report = verify(workload, batch=16, steps=4)
    full, weighted, _ = reference_grads(workload.model, mse, split_batch(regression_batch(16), [4] * 4))
    assert report.max_rel_diff == pytest.approx(max_rel(weighted, full), rel=1e-6) and not report.equivalent
    assert [d.kind for d in report.diagnostics] == ["coupled"]  # centering mixes the samples


# ---------------------------------------------------------------------- report and errors


def test_report_is_frozen_printable_and_json_ready() -> None:
    report = verify(load_workload("seed-linear"), batch=10, steps=3, dtype=torch.float64)
    assert isinstance(report, VerifyReport) and report.micro_batch_sizes == (4, 3, 3)
    with pytest.raises(AttributeError):
        report.batch = 3  # type: ignore[misc]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["loss_diff"] == pytest.approx(report.loss_diff) and data["dtype"] == "float64"
    assert "micro-batches of 4, 3, 3" in str(report)


def test_bad_arguments_and_workloads(capsys) -> None:
    workload = load_workload("seed-linear")
    with pytest.raises(ConfigError, match="steps"):
        verify(workload, batch=4, steps=8)
    with pytest.raises(ConfigError, match="batch"):
        verify(workload, batch=0)
    with pytest.raises(ConfigError, match="rtol"):
        verify(workload, rtol=-1.0)
    with pytest.raises(ConfigError, match="Workload"):
        verify(workload.model)  # type: ignore[arg-type]
    wrong_size = Workload(model=nn.Linear(6, 2), make_batch=lambda b: regression_batch(b + 1), loss=mse)
    with pytest.raises(WorkloadError, match="make_batch"):
        verify(wrong_size, batch=8, steps=2)
    not_scalar = Workload(
        model=nn.Linear(6, 2).double(), make_batch=regression_batch, loss=lambda m, b: (m(b[0]), 1)
    )
    with pytest.raises(WorkloadError, match="scalar"):
        verify(not_scalar, batch=8, steps=2)

    not_finite = Workload(
        model=nn.Linear(6, 2).double(),
        make_batch=regression_batch,
        loss=lambda m, b: (mse(m, b)[0] * float("inf"), b[0].shape[0]),
    )
    with pytest.raises(WorkloadError, match="not finite"):
        verify(not_finite, batch=8, steps=2)

    assert main(["verify", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["verify", "seed-linear", "--batch", "2", "--steps", "4"]) == 2
    assert "steps (4) must be <= batch (2)" in capsys.readouterr().err
