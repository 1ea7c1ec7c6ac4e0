"""The loss head in chunks (checkpointing/head.py): the unchunked gradient, never all logits alive."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import microbatch as mb
from equivalence import accumulated_grads, assert_grads_close, full_batch_grads, grads_of
from microbatch.checkpointing import chunk_head, chunked_cross_entropy
from microbatch.errors import ConfigError
from microbatch.models import GPT, GPTConfig
from microbatch.models.workloads import gpt_loss
from microbatch.trees.batches import split_batch

# float64 throughout: chunking changes only the order of the sums over tokens.
F64 = {"rtol": 1e-10, "atol": 1e-12}


def gpt_batch(rows: int, length: int, *, vocab: int = 256, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, length // 2 :] = -100  # padding
    return {"input_ids": ids[:, :-1], "labels": labels}


def test_chunked_cross_entropy_is_the_plain_sum_and_count() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 50, bias=True).double()
    targets = torch.randint(0, 50, (3, 11), generator=g)
    targets[0, 3:7] = -100
    want = F.cross_entropy(head(hidden).reshape(-1, 50), targets.reshape(-1), reduction="sum")
    want.backward()
    want_grads = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    hidden.grad = head.weight.grad = head.bias.grad = None
    got, count = chunked_cross_entropy(hidden, head, targets, chunk_tokens=4)  # 33 tokens: 8 x 4 + 1
    got.backward()
    assert int(count) == 33 - 4
    torch.testing.assert_close(got, want, **F64)
    for actual, expected in zip((hidden.grad, head.weight.grad, head.bias.grad), want_grads, strict=True):
        torch.testing.assert_close(actual, expected, **F64)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, head, targets, chunk_tokens=0)


def test_gpt_chunked_window_gives_the_full_batch_gradient() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32)).double()
    batch = gpt_batch(6, 24)
    expected, expected_loss = full_batch_grads(model, gpt_loss, batch)  # unchunked
    chunked = copy.deepcopy(model)
    handle = chunk_head(chunked, tokens=7)  # 24-token rows: chunks cross rows, the last is short
    assert chunked.head_chunk_tokens == 7
    actual, stats = accumulated_grads(chunked, gpt_loss, split_batch(batch, [3, 1, 2]))
    assert_grads_close(actual, expected, **F64)
    assert stats.items == int((batch["labels"] != -100).sum())
    assert stats.loss == pytest.approx(expected_loss, rel=1e-10)
    handle.remove()
    assert chunked.head_chunk_tokens is None


def _logit_bytes_alive(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    with mb.MemoryTracker(model=model) as tracker:
        loss, _ = gpt_loss(model, batch)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def test_gpt_chunked_head_never_holds_all_logits() -> None:
    torch.manual_seed(0)
    vocab, rows, length = 4096, 4, 64  # logits: 256 tokens x 4096 x 4 bytes = 4 MiB per copy
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=64, vocab_size=vocab))
    batch = gpt_batch(rows, length, vocab=vocab)
    plain = _logit_bytes_alive(model, batch)
    handle = chunk_head(model, tokens=32)
    chunked = _logit_bytes_alive(model, batch)
    handle.remove()
    logits_bytes = rows * length * vocab * 4
    # Unchunked: the logits, their log-softmax and its gradient (>= 2 copies) at once; chunked: one
    # chunk of 32 tokens of each (1/8 of a copy).
    assert plain - chunked > 1.5 * logits_bytes, (plain, chunked, logits_bytes)


def test_chunk_head_refuses_what_it_cannot_chunk() -> None:
    with pytest.raises(ConfigError, match="no loss head"):
        chunk_head(torch.nn.Linear(3, 3), tokens=8)
    with pytest.raises(ConfigError, match="tokens"):
        chunk_head(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)), tokens=0)


# --------------------------------------------------------------------------------------------------
# transformers causal LMs


def _float64_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its cast to float32 (so float64 compares at 1e-10)."""
    shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_chunked_window_gives_the_unchunked_gradient(family: str) -> None:
    hf = pytest.importorskip("microbatch.hf")
    pytest.importorskip("transformers")
    factory = hf.tiny_gpt2 if family == "gpt2" else hf.tiny_llama
    model = factory(vocab_size=300, dtype=torch.float64)
    model.loss_function = _float64_loss
    sequences = [torch.arange(1 + i, 1 + i + n) % 299 + 1 for i, n in enumerate([9, 16, 3, 12, 16, 7])]
    batch = hf.pad_causal_lm_batch(sequences)
    batch["labels"][3, :4] = -100  # a masked prompt
    micro = split_batch(batch, [2, 3, 1])
    # Llama's RMSNorm and rotary angles run in float32 whatever the dtype, so its gradient depends on
    # the split: compare with the same window unchunked. GPT-2 is float64 throughout: the full batch.
    if family == "gpt2":
        expected, _ = full_batch_grads(model, hf.causal_lm_loss, batch)
    else:
        expected, _ = accumulated_grads(model, hf.causal_lm_loss, micro)
    chunked = copy.deepcopy(model)
    handle = chunk_head(chunked, tokens=5)  # 16-token rows: uneven chunks across rows
    actual, stats = accumulated_grads(chunked, hf.causal_lm_loss, micro)
    assert_grads_close(actual, expected, **F64)
    assert stats.items == hf.count_causal_lm_items(batch["labels"])
    chunked.eval()
    with torch.no_grad():  # evaluation keeps the original forward and its logits
        assert chunked(**batch).logits.shape == (6, 16, 300)
    handle.remove()
    assert "forward" not in vars(chunked)


def test_chunked_head_under_fit_trainer(tmp_path: Any) -> None:
    hf = pytest.importorskip("microbatch.hf")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = hf.tiny_gpt2(vocab_size=300, dtype=torch.float64)
    model.loss_function = _float64_loss
    reference = copy.deepcopy(model)
    rows = [torch.randint(1, 300, (int(n),), generator=torch.Generator().manual_seed(i)) for i, n in
            enumerate([5, 16, 9, 16, 3, 12, 16, 8])]  # fmt: skip
    padded = hf.pad_causal_lm_batch(rows, max_length=16)
    padded["labels"][2, :3] = -100
    examples = [{key: value[i] for key, value in padded.items()} for i in range(8)]
    settings = {
        "output_dir": str(tmp_path), "max_steps": 1, "learning_rate": 1e-3, "max_grad_norm": 0.0,
        "report_to": [], "save_strategy": "no", "use_cpu": True, "dataloader_num_workers": 0,
        "train_sampling_strategy": "sequential",
    }  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**settings),
        train_dataset=examples,
        data_collator=transformers.default_data_collator,
    )
    hf.fit_trainer(trainer, batch=8, memory="2GiB", trial=False, policies=["none"])
    chunk_head(trainer.model, tokens=6)
    assert trainer.args.gradient_accumulation_steps * trainer.args.per_device_train_batch_size == 8
    grads: dict[str, torch.Tensor] = {}

    class Capture(transformers.TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            grads.update(grads_of(model))

    trainer.add_callback(Capture())
    trainer.train()
    expected, _ = full_batch_grads(reference, hf.causal_lm_loss, padded)
    assert_grads_close(grads, expected, **F64)
