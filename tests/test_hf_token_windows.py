"""fit_trainer(max_tokens=...): windows cut into micro-batches by padded tokens (hf/token_batches.py)
give the float64 full-batch gradient of the window's samples. Tolerance rtol 1e-9, atol 1e-12 (a
different summation order; a BERT masked LM, whose loss stays in float64, unlike a causal LM's)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from microbatch import hf
from microbatch.errors import ConfigError
from microbatch.hf.token_batches import TokenWindowSampler, cut_by_tokens
from test_hf_exact import (
    SAMPLES,
    TOL,
    Examples,
    _first_step,
    _model,
    _trainer,
    collate,
    full_batch_gradient,
    masked_example,
)


def test_cut_by_tokens_keeps_every_sample_within_the_budget() -> None:
    lengths = [5, 30, 7, 12, 30, 3, 9]
    pieces = cut_by_tokens(range(len(lengths)), lengths, 40)
    assert sorted(i for piece in pieces for i in piece) == list(range(len(lengths)))
    assert all(len(piece) * max(lengths[i] for i in piece) <= 40 for piece in pieces)
    sampler = TokenWindowSampler(lengths, batch=4, max_tokens=40)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 2 * sampler.steps  # two windows, each of `steps` micro-batches
    with pytest.raises(ConfigError, match="max_tokens=20 is below the longest sample"):
        TokenWindowSampler(lengths, batch=4, max_tokens=20)


def _pieces(lengths: list[int], tokens: int, seed: int) -> int:
    window = TokenWindowSampler(lengths, batch=SAMPLES // 2, max_tokens=tokens, seed=seed).windows()[0]
    return len(cut_by_tokens(window, lengths, tokens))


def _steps(lengths: list[int], tokens: int) -> int:
    return TokenWindowSampler(lengths, batch=SAMPLES // 2, max_tokens=tokens).steps


def test_token_windows_give_the_full_batch_gradient(tmp_path: Any) -> None:
    name = "bert-masked-lm"
    model = _model(name)
    reference = copy.deepcopy(model)
    dataset = Examples(masked_example)
    trainer = _trainer(tmp_path, model, dataset, steps=1)  # max_steps=1: the first window
    lengths = [len(row["input_ids"]) for row in dataset.rows]
    # A budget that cuts the first window into >= 2 micro-batches, fewer than the worst window needs:
    # the window then ends in empty micro-batches, which must add nothing.
    budget = next(
        tokens
        for tokens in range(max(lengths), SAMPLES * max(lengths))
        if 2 <= _pieces(lengths, tokens, int(trainer.args.seed)) < _steps(lengths, tokens)
    )
    plan = hf.fit_trainer(
        trainer, batch=SAMPLES // 2, memory="2GiB", trial=False, policies=["none"], max_tokens=budget
    )
    assert plan.max_tokens == budget and any("token budget" in note for note in plan.notes)
    sampler = trainer.microbatch_token_sampler
    window = sampler.windows()[0]
    assert len(cut_by_tokens(window, lengths, budget)) < sampler.steps
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    got = _first_step(trainer)
    assert len(rows) == sampler.steps == trainer.args.gradient_accumulation_steps
    want = full_batch_gradient(reference, collate([dataset[i] for i in window]))
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
