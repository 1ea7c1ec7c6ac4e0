"""Built-in workloads: the GPT on the stdlib corpus, a tiny exactness LM, and a BatchNorm CNN.

Every factory builds its model under a fixed seed without touching the global RNG, and gives
``make_batch`` its own torch.Generator, so the same sequence of calls yields the same batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError
from ..trees.modules import unwrap_compiled
from ..workload import Workload
from .cnn import DigitBatches, SmallCNN, load_digits_tensors
from .corpus import DEFAULT_MAX_BYTES, IGNORE_INDEX, PAD_TOKEN, ByteBatches, load_corpus
from .gpt import GPT, GPTConfig, gpt_config, token_loss


def build_seeded(factory: Any, seed: int) -> Any:
    """``factory()`` with the global torch RNG seeded to ``seed`` and restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def gpt_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-byte cross entropy over the counted tokens, and their count."""
    # A GPT whose head is chunked computes the loss itself, given the labels, never holding all the
    # logits. Otherwise (gpt_loss is also the loss of user models that return logits, and of a
    # wrapper whose inner GPT cannot be seen) the logits, then token_loss, after the model returns:
    # where the profile and the pipeline's last stage (gpt_output_loss) put the loss.
    inner = unwrap_compiled(model)
    if isinstance(inner, GPT) and inner.head_chunk_tokens is not None:
        loss, count = model(batch["input_ids"], labels=batch["labels"], ignore_index=IGNORE_INDEX)
        return loss, count
    return token_loss(model(batch["input_ids"]), batch["labels"], ignore_index=IGNORE_INDEX)


def gpt_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A GPT batch as a pipeline takes it: the token ids into the first stage, the labels to the loss."""
    return batch["input_ids"], batch["labels"]


def gpt_output_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt_loss from the model's output: what the last pipeline stage computes."""
    return token_loss(logits, labels, ignore_index=IGNORE_INDEX)


def gpt_optimizer(
    model: nn.Module, *, lr: float = 3e-3, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm or position vectors)."""
    decayed = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def gpt_workload(
    size: str | GPTConfig = "gpt-mini",
    *,
    seed: int = 0,
    data_seed: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    lr: float = 3e-3,
) -> Workload:
    """A GPT (a named size or a GPTConfig) trained on the stdlib corpus, token-mean loss."""
    config = gpt_config(size) if isinstance(size, str) else size
    corpus = load_corpus(max_bytes=max_bytes)
    model = build_seeded(lambda: GPT(config), seed)
    batches = ByteBatches(
        corpus.train, block_size=config.block_size, seed=seed if data_seed is None else data_seed
    )
    return Workload(
        model=model,
        make_batch=batches,
        loss=gpt_loss,
        optimizer=lambda m: gpt_optimizer(m, lr=lr),
        name=size if isinstance(size, str) else "gpt",
        description=f"byte-level GPT {config.n_layer}x{config.n_embd} on {corpus}",
        max_length=config.block_size,
        pipeline_inputs=gpt_inputs,
        pipeline_loss=gpt_output_loss,
    )


def gpt_mini() -> Workload:
    """The built-in GPT gpt-mini on the stdlib corpus."""
    return gpt_workload("gpt-mini")


def gpt_nano() -> Workload:
    """The built-in GPT gpt-nano on the stdlib corpus."""
    return gpt_workload("gpt-nano")


def gpt_12l() -> Workload:
    """The built-in GPT gpt-12l on the stdlib corpus."""
    return gpt_workload("gpt-12l")


def gpt_small() -> Workload:
    """The built-in GPT gpt-small on the stdlib corpus."""
    return gpt_workload("gpt-small")


def gpt_medium() -> Workload:
    """The built-in GPT gpt-medium on the stdlib corpus."""
    return gpt_workload("gpt-medium")


class VarlenTokens:
    """Random byte sequences of random lengths in [min_length, block_size], padded like ByteBatches."""

    def __init__(self, *, block_size: int, min_length: int = 2, vocab_size: int = 256, seed: int = 0) -> None:
        if not 1 <= min_length <= block_size:
            raise ConfigError(f"min_length must be in [1, block_size={block_size}], got {min_length}")
        self.block_size, self.min_length, self.vocab_size = block_size, min_length, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        tokens = torch.randint(
            0, self.vocab_size, (batch_size, self.block_size + 1), generator=self.generator
        )
        lengths = torch.randint(
            self.min_length, self.block_size + 1, (batch_size, 1), generator=self.generator
        )
        valid = torch.arange(self.block_size).unsqueeze(0) < lengths
        input_ids = torch.where(valid, tokens[:, :-1], PAD_TOKEN)
        labels = torch.where(valid, tokens[:, 1:], IGNORE_INDEX)
        return {"input_ids": input_ids, "labels": labels}


def lm_varlen() -> Workload:
    """A 2-layer GPT (n_embd 32, block 32, no dropout) on random variable-length sequences.

    Small and deterministic, for exactness tests; ``workload.model.double()`` works (the batches
    are integer tokens).
    """
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0)
    model = build_seeded(lambda: GPT(config), 0)
    return Workload(
        model=model,
        make_batch=VarlenTokens(block_size=config.block_size, seed=0),
        loss=gpt_loss,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        name="lm-varlen",
        description="2-layer byte GPT on random variable-length padded sequences (token-mean loss)",
        max_length=config.block_size,
    )


def cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    images, labels = batch
    return F.cross_entropy(model(images), labels), int(labels.shape[0])


def cnn_bn() -> Workload:
    """The BatchNorm CNN on 8x8 digits (scikit-learn's bundled set, or generated images)."""
    images, labels = load_digits_tensors()
    model = build_seeded(SmallCNN, 0)
    return Workload(
        model=model,
        make_batch=DigitBatches(images, labels, seed=0),
        loss=cnn_loss,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        name="cnn-bn",
        description="3-block CNN with BatchNorm on 8x8 digits, cross entropy",
    )
