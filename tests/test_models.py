"""Built-in models, the stdlib corpus and the built-in workloads."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from microbatch.errors import ConfigError
from microbatch.models import (
    GPT,
    GPT_SIZES,
    ByteBatches,
    GPTConfig,
    SmallCNN,
    gpt_config,
    load_corpus,
    token_loss,
)
from microbatch.models.cnn import load_digits_tensors
from microbatch.models.workloads import VarlenTokens
from microbatch.workload import load_workload

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)


def tiny_gpt(**overrides: object) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(**{**TINY.to_dict(), **overrides})  # type: ignore[arg-type]
    return GPT(config).double().eval()


def test_gpt_logits_shape_and_blocks() -> None:
    model = tiny_gpt()
    idx = torch.randint(0, 256, (3, 10))
    assert model(idx).shape == (3, 10, 256)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == TINY.n_layer


def test_gpt_is_causal() -> None:
    # Changing the tokens after position t must leave the logits at positions <= t unchanged.
    model = tiny_gpt()
    idx = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7], rtol=0, atol=1e-12)
    assert (before[:, 7:] - after[:, 7:]).abs().max() > 1e-6


def test_gpt_rejects_too_long_sequences() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        tiny_gpt()(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_weight_tying_is_optional() -> None:
    tied, untied = tiny_gpt(), tiny_gpt(tie_weights=False)
    assert tied.lm_head.weight is tied.token_embedding.weight
    assert untied.lm_head.weight is not untied.token_embedding.weight
    assert untied.num_parameters() == tied.num_parameters() + 256 * TINY.n_embd


def test_token_loss_is_mean_over_counted_tokens() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 256, dtype=torch.float64, generator=generator)
    targets = torch.randint(0, 256, (2, 5), generator=generator)
    targets[0, 3:] = -100
    targets[1, 4] = -100
    loss, count = token_loss(logits, targets)
    assert count == 7
    keep = targets != -100
    reference = torch.stack(
        [-torch.log_softmax(logits[b, t], -1)[targets[b, t]] for b, t in keep.nonzero().tolist()]
    ).mean()
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)


def test_token_loss_without_counted_tokens_is_zero_and_differentiable() -> None:
    logits = torch.randn(1, 3, 256, requires_grad=True)
    loss, count = token_loss(logits, torch.full((1, 3), -100))
    loss.backward()
    assert count == 0
    assert loss.item() == 0.0
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad) == 0


def test_named_sizes_and_unknown_size() -> None:
    assert gpt_config("gpt-mini") == GPT_SIZES["gpt-mini"]
    assert gpt_config("gpt-mini", dropout=0.1).dropout == 0.1
    with torch.device("meta"):
        small = GPT(gpt_config("gpt-small"))
    assert 80e6 < small.num_parameters(include_embeddings=False) < 90e6
    with pytest.raises(ConfigError, match="gpt-mini"):
        gpt_config("gpt-huge")
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(n_head=3, n_embd=16)


def test_corpus_is_deterministic_and_split_by_file() -> None:
    first = load_corpus(max_bytes=300_000)
    load_corpus.cache_clear()
    second = load_corpus(max_bytes=300_000)
    assert first == second
    assert first.train
    assert first.validation
    assert not set(first.train_paths) & set(first.validation_paths)
    assert all(path.endswith(".py") and "site-packages" not in path for path in first.train_paths)
    assert first.train_bytes + first.validation_bytes <= 300_000
    # A file keeps its split when the byte cap grows.
    larger = load_corpus(max_bytes=600_000)
    assert set(first.validation_paths) <= set(larger.validation_paths)
    assert set(first.train_paths) <= set(larger.train_paths)


def test_byte_batches_are_shifted_padded_and_reproducible() -> None:
    corpus = load_corpus(max_bytes=200_000)
    source = ByteBatches(corpus.train, block_size=32, seed=5)
    state = source.state_dict()
    batch = source(16)
    assert batch["input_ids"].shape == batch["labels"].shape == (16, 32)
    counted = batch["labels"] != -100
    lengths = counted.sum(1)
    assert lengths.min() >= 1
    assert len(set(lengths.tolist())) > 1  # rows carry different token counts
    # Counted positions form a prefix, and the labels are the inputs shifted by one byte.
    assert torch.equal(counted, torch.arange(32) < lengths.unsqueeze(1))
    torch.testing.assert_close(
        batch["labels"][:, :-1][counted[:, 1:]], batch["input_ids"][:, 1:][counted[:, 1:]]
    )
    assert (batch["input_ids"][~counted] == 0).all()
    # Same seed, or restored state: same batches; a different seed: different ones.
    again = ByteBatches(corpus.train, block_size=32, seed=5)
    assert torch.equal(again(16)["input_ids"], batch["input_ids"])
    source.load_state_dict(state)
    assert torch.equal(source(16)["labels"], batch["labels"])
    assert not torch.equal(
        ByteBatches(corpus.train, block_size=32, seed=6)(16)["input_ids"], batch["input_ids"]
    )


def test_micro_batches_carry_different_token_counts() -> None:
    source = ByteBatches(load_corpus(max_bytes=200_000).train, block_size=64, seed=0)
    counts = {int((source(4)["labels"] != -100).sum()) for _ in range(6)}
    assert len(counts) > 1


def test_varlen_tokens_pad_after_length() -> None:
    batch = VarlenTokens(block_size=8, seed=0)(32)
    counted = batch["labels"] != -100
    assert torch.equal(counted, torch.arange(8) < counted.sum(1, keepdim=True))
    assert len(set(counted.sum(1).tolist())) > 1


def test_cnn_forward_and_digits() -> None:
    images, labels = load_digits_tensors()
    assert images.shape[1:] == (1, 8, 8)
    assert images.dtype == torch.float32
    assert images.min() >= 0.0
    assert images.max() <= 1.0
    assert set(labels.unique().tolist()) == set(range(10))
    generated, generated_labels = load_digits_tensors(use_sklearn=False)
    assert generated.shape[1:] == (1, 8, 8)
    assert set(generated_labels.unique().tolist()) == set(range(10))
    model = SmallCNN()
    assert model(images[:5]).shape == (5, 10)
    assert any(isinstance(module, torch.nn.BatchNorm2d) for module in model.modules())


@pytest.mark.parametrize("name", ["gpt-mini", "lm-varlen", "cnn-bn"])
def test_builtin_workloads_load_and_are_deterministic(name: str) -> None:
    first, second = load_workload(name), load_workload(name)
    for p, q in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)
    batch_one = [first.make_batch(3) for _ in range(2)]
    batch_two = [second.make_batch(3) for _ in range(2)]
    for one, two in zip(batch_one, batch_two, strict=True):
        flat_one = one.values() if isinstance(one, dict) else one
        flat_two = two.values() if isinstance(two, dict) else two
        for a, b in zip(flat_one, flat_two, strict=True):
            assert torch.equal(a, b)
    loss, items = first.loss(first.model, batch_one[0])
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    assert int(items) >= 1
    assert isinstance(first.make_optimizer(), torch.optim.Optimizer)


def test_lm_varlen_token_weighting_matters_in_float64() -> None:
    # The window loss sum_i(n_i * mean_i) / sum_i(n_i) equals the full batch's token mean;
    # the plain mean of the micro-batch means does not when token counts differ.
    workload = load_workload("lm-varlen")
    model = workload.model.double()
    batch = workload.make_batch(8)
    full_loss, full_items = workload.loss(model, batch)
    halves = [{key: value[i : i + 4] for key, value in batch.items()} for i in (0, 4)]
    parts = [workload.loss(model, half) for half in halves]
    weighted = sum(loss * items for loss, items in parts) / sum(items for _, items in parts)
    torch.testing.assert_close(weighted, full_loss, rtol=1e-12, atol=1e-12)
    assert full_items == sum(items for _, items in parts)
    assert parts[0][1] != parts[1][1]
    assert abs(float((parts[0][0] + parts[1][0]).detach() / 2 - full_loss.detach())) > 1e-6


def test_gpt_mean_loss_reference() -> None:
    model = tiny_gpt()
    batch = VarlenTokens(block_size=16, seed=3)(4)
    logits = model(batch["input_ids"])
    loss, _ = token_loss(logits, batch["labels"])
    reference = F.cross_entropy(logits.reshape(-1, 256), batch["labels"].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, reference, rtol=1e-12, atol=1e-12)
