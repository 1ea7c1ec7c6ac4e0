"""CachedSentenceLoss: a sentence-transformers in-batch-negatives loss over the whole batch, exactly.

A tiny BERT SentenceTransformer (config + word-level vocab saved to a temporary folder, nothing
downloaded; dropout 0, as the full batch draws other masks than micro-batches do, and the replay of
dropout is tested in tests/test_cached.py), float64, batch 24 of (anchor, positive) pairs of
different lengths in micro-batches of 8 (so padding is trimmed per micro-batch). Reference:
MultipleNegativesRankingLoss on the whole batch at once, backpropagated in the test. rtol 1e-9,
atol 1e-12 (float64 rounding; a loss computed per micro-batch, with 7 negatives instead of 23,
misses by tens of percent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from microbatch import hf
from microbatch.errors import ConfigError

st = pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-9, "atol": 1e-12}
WORDS = [f"w{i}" for i in range(40)]


def tiny_sentence_transformer(folder: Path) -> Any:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    transformer = st.sentence_transformer.modules.Transformer(str(folder))
    pooling = st.sentence_transformer.modules.Pooling(transformer.get_embedding_dimension(), "mean")
    return st.SentenceTransformer(modules=[transformer, pooling], device="cpu").to(torch.float64)


def _sentences(count: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(2, 14, (1,), generator=generator))
        out.append(" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator)))
    return out


def _features(model: Any, count: int = 24) -> list[dict[str, torch.Tensor]]:
    return [model.tokenize(_sentences(count, seed)) for seed in (1, 2)]


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_cached_sentence_loss_is_the_full_batch_mnrl(tmp_path: Path) -> None:
    model = tiny_sentence_transformer(tmp_path)
    model.train()
    features = _features(model)
    labels = torch.zeros(24)
    mnrl = st.sentence_transformer.losses.MultipleNegativesRankingLoss(model)
    mnrl(features, labels).backward()  # the whole batch at once
    want = _grads(model)
    model.zero_grad()
    cached = hf.CachedSentenceLoss(model, mnrl, micro_batch_size=8)
    value = cached(features, labels)
    value.backward()
    got = _grads(model)
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=lambda m, key=key: f"{key}: {m}")


def test_padding_is_trimmed_per_micro_batch() -> None:
    features = {
        "input_ids": torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
    }
    trimmed = hf.trim_padding(features)
    assert trimmed["input_ids"].tolist() == [[5, 6], [7, 0]] and trimmed["attention_mask"].shape == (2, 2)


def test_a_loss_without_embeddings_entry_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="compute_loss_from_embeddings"):
        hf.CachedSentenceLoss(torch.nn.Linear(2, 2), torch.nn.MSELoss(), micro_batch_size=4)
