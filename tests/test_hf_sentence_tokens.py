"""CachedSentenceLoss(max_tokens=): the whole batch's MNRL, the encoder run by padded tokens.

The tiny float64 BERT SentenceTransformer of tests/test_hf_sentence.py (dropout 0), a batch of 24
long-tailed (anchor, positive) pairs (most 2-8 words, a few 40-50), max_tokens = 2 x the longest
row. Reference: MultipleNegativesRankingLoss on the whole batch at once. rtol 1e-9, atol 1e-12.
Every encode pass (a forward pre-hook on the model) holds rows x columns <= max_tokens after the
padding is trimmed, and the rows were reordered (longest first) and put back. Whole run: four
long-tailed steps of 24 pairs, peaks by a MemoryTracker in the test, within a budget of 1.1x the
worst batch's peak by tokens (measured 0.97x), over it by fixed rows (2.14x).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import microbatch as mb
from microbatch import hf
from microbatch.accumulate.cached_tokens import cut_batch_by_tokens
from microbatch.errors import ConfigError
from microbatch.hf.lengths import read_lengths, text_length

st = pytest.importorskip("sentence_transformers")
pytest.importorskip("transformers")

from test_hf_sentence import TOL, WORDS, _grads, tiny_sentence_transformer  # noqa: E402


def _long_tailed(count: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        long = float(torch.rand((), generator=generator)) < 0.2
        low, high = (40, 51) if long else (2, 9)
        length = int(torch.randint(low, high, (), generator=generator))
        out.append(" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator)))
    return out


def test_max_tokens_is_the_full_batch_mnrl(tmp_path: Path) -> None:
    model = tiny_sentence_transformer(tmp_path)
    model.train()
    texts = [_long_tailed(24, seed) for seed in (5, 6)]
    features = [model.tokenize(column) for column in texts]  # the forward adds to these dicts: fresh below
    longest = max(int(f["attention_mask"].sum(dim=1).max()) for f in features)
    labels = torch.zeros(24)
    mnrl = st.sentence_transformer.losses.MultipleNegativesRankingLoss(model)
    want_loss = mnrl(features, labels)
    want_loss.backward()
    want = _grads(model)
    model.zero_grad()
    passes: list[tuple[int, int]] = []

    def record(module: Any, args: tuple[Any, ...]) -> None:
        passes.append(tuple(args[0]["input_ids"].shape))

    handle = model.register_forward_pre_hook(record)
    cached = hf.CachedSentenceLoss(model, mnrl, max_tokens=2 * longest)
    value = cached([model.tokenize(column) for column in texts], labels)
    value.backward()
    handle.remove()
    assert len(passes) > 2 * len(features)  # more than one mini-batch per column
    assert all(rows * columns <= 2 * longest for rows, columns in passes)
    assert cut_batch_by_tokens(features[0], 2 * longest).order != list(range(24))  # reordered, put back
    torch.testing.assert_close(value, want_loss, **TOL)
    got = _grads(model)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")
    assert cached.get_config_dict()["max_tokens"] == 2 * longest


def test_exactly_one_of_rows_and_tokens(tmp_path: Path) -> None:
    model = tiny_sentence_transformer(tmp_path)
    mnrl = st.sentence_transformer.losses.MultipleNegativesRankingLoss(model)
    with pytest.raises(ConfigError, match="exactly one of micro_batch_size"):
        hf.CachedSentenceLoss(model, mnrl)
    with pytest.raises(ConfigError, match="exactly one of micro_batch_size"):
        hf.CachedSentenceLoss(model, mnrl, micro_batch_size=4, max_tokens=64)
    with pytest.raises(ConfigError, match="max_tokens must be a positive int"):
        hf.CachedSentenceLoss(model, mnrl, max_tokens=0)


def test_a_long_tailed_run_peaks_within_the_budget_by_tokens_and_over_it_by_rows(tmp_path: Path) -> None:
    """Whole run (issue 33): the budget is 1.1x the measured peak of the worst batch this data can
    give (every row of the longest length) with max_tokens = 4 x longest; then every step of a run of
    long-tailed batches, by a MemoryTracker opened in the test, peaks within it by tokens, and a fixed
    row count making as many encode passes goes over it (a mini-batch that draws long documents)."""
    model = tiny_sentence_transformer(tmp_path)
    model.train()
    mnrl = st.sentence_transformer.losses.MultipleNegativesRankingLoss(model)
    rows = 24
    steps = [[_long_tailed(rows, seed) for seed in (20 + 2 * step, 21 + 2 * step)] for step in range(4)]
    longest_text = max((text for step in steps for column in step for text in column), key=len)
    longest = int(model.tokenize([longest_text])["attention_mask"].sum())
    max_tokens = 4 * longest
    labels = torch.zeros(rows)

    def peak(loss: Any, texts: list[list[str]]) -> int:
        features = [model.tokenize(column) for column in texts]
        with mb.MemoryTracker("cpu", model=model) as tracker:
            loss(features, labels).backward()
        model.zero_grad(set_to_none=True)
        return tracker.peak_bytes

    by_tokens = hf.CachedSentenceLoss(model, mnrl, max_tokens=max_tokens)
    model(model.tokenize(["warm up"]))  # nothing of the first call is counted below
    budget = int(1.1 * peak(by_tokens, [[longest_text] * rows] * 2))
    passes = 0
    for texts in steps:
        for column in texts:
            passes += len(cut_batch_by_tokens(model.tokenize(column), max_tokens).groups)
    fixed_rows = -(-2 * rows * len(steps) // passes)  # the token cut's mean rows per pass, rounded up
    by_rows = hf.CachedSentenceLoss(model, mnrl, micro_batch_size=fixed_rows)
    token_peaks = [peak(by_tokens, texts) for texts in steps]
    row_peaks = [peak(by_rows, texts) for texts in steps]
    worst_tokens, worst_rows = max(token_peaks) / budget, max(row_peaks) / budget
    print(f"budget {budget} B: by tokens {worst_tokens:.2f}x, by {fixed_rows} rows {worst_rows:.2f}x")
    assert max(token_peaks) <= budget
    assert max(row_peaks) > budget


def test_a_sentence_dataset_is_read_for_lengths_by_its_tokenizer(tmp_path: Path) -> None:
    """Issue 33 for sentence-transformers: their datasets hold text columns; hf/lengths.py reads them
    with the model's tokenizer (no forward pass), longest first, for the worst mini-batch a run can draw."""
    datasets = pytest.importorskip("datasets")
    model = tiny_sentence_transformer(tmp_path)
    anchors, positives = _long_tailed(30, 7), _long_tailed(30, 8)
    dataset = datasets.Dataset.from_dict({"anchor": anchors, "positive": positives, "score": [1.0] * 30})
    lengths = read_lengths(dataset, length=text_length(model.tokenizer))
    assert lengths is not None and not lengths.sampled
    want = [
        max(len(model.tokenizer(text)["input_ids"]) for text in pair)
        for pair in zip(anchors, positives, strict=True)
    ]
    assert list(lengths.lengths) == sorted(want, reverse=True)
    assert lengths.lengths[0] > 40 > lengths.lengths[-1]  # the long tail, read
    only_anchors = read_lengths(dataset, length=text_length(model.tokenizer, columns=["anchor"]))
    assert only_anchors is not None
    assert max(only_anchors.lengths) == max(len(model.tokenizer(a)["input_ids"]) for a in anchors)
    assert text_length(model.tokenizer)({"score": 1.0}) is None
