"""A byte-level GPT in plain PyTorch: the built-in model that ``microbatch train`` plans for.

Vocabulary: the 256 byte values, nothing else. Pre-LayerNorm blocks
(x + attn(ln(x)), then x + mlp(ln(x))), causal self-attention through
``scaled_dot_product_attention(is_causal=True)``, a GELU MLP of width 4 * n_embd, learned position
embeddings, optional tying of the output projection to the token embedding.

``GPT.forward(idx)`` returns logits; ``token_loss`` turns logits and shifted labels into the mean
over non-ignored tokens and their count, which is what exact accumulation needs
(the window loss is sum_i(count_i * mean_i) / sum_i(count_i)). ``GPT.forward(idx, labels)`` returns
that (mean, count) itself, and with ``head_chunk_tokens`` set (``microbatch.chunk_head``) computes it
without ever holding all the logits (``checkpointing.head``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, overload

import torch
from torch import nn
from torch.nn import functional as F

from ..checkpointing.head import chunked_cross_entropy
from ..errors import ConfigError

VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``n_embd`` must be divisible by ``n_head``."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    vocab_size: int = VOCAB_SIZE
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Named sizes. gpt-nano is for tests and smoke runs (seconds). gpt-mini is the CPU default: 200
# optimizer steps at effective batch 64 cost about 55 CPU-seconds on one thread (measured
# 0.25-0.29 s per step), so the default run takes about a minute on 2 cores; block_size 64 rather
# than 128 halves that. gpt-12l is deep and thin, for profiling and checkpointing tests. gpt-small
# (~85M parameters, GPT-2 small's body) and gpt-medium (~300M) are for GPUs.
GPT_SIZES: dict[str, GPTConfig] = {
    "gpt-nano": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32),
    "gpt-mini": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64),
    "gpt-12l": GPTConfig(n_layer=12, n_head=4, n_embd=64, block_size=64),
    "gpt-small": GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
}


def gpt_config(name: str, **overrides: Any) -> GPTConfig:
    """The GPTConfig of a named size (see GPT_SIZES), with fields replaced by ``overrides``."""
    if name not in GPT_SIZES:
        raise ConfigError(f"unknown GPT size {name!r}; the built-in sizes are: {', '.join(GPT_SIZES)}")
    config = GPT_SIZES[name]
    unknown = sorted(set(overrides) - set(config.to_dict()))
    if unknown:
        raise ConfigError(f"GPTConfig has no field(s) {', '.join(unknown)}")
    return replace(config, **overrides) if overrides else config


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        head_dim = channels // self.n_head
        # (B, T, 3C) -> three (B, n_head, T, head_dim)
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_head, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, time, channels)
        out: torch.Tensor = self.resid_dropout(self.proj(y))
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dropout(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """Byte-level GPT; ``forward(idx) -> logits`` of shape (batch, time, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        # Tokens per chunk of the loss head when forward is given labels; None: all logits at once.
        self.head_chunk_tokens: int | None = None
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) so the residual stream's
        # variance stays O(1) after n_layer blocks each adding two branches.
        for name, parameter in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self, *, include_embeddings: bool = True) -> int:
        """Parameter count (tied weights once); without position and token embeddings if asked."""
        total = sum(parameter.numel() for parameter in self.parameters())
        if not include_embeddings:
            total -= self.position_embedding.weight.numel() + self.token_embedding.weight.numel()
        return total

    @overload
    def forward(self, idx: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(
        self, idx: torch.Tensor, labels: torch.Tensor, ignore_index: int = ...
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, idx: torch.Tensor, labels: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits; or, given shifted ``labels``, ``token_loss``'s (mean loss, count) (chunked if asked)."""
        time = idx.shape[1]
        if time > self.config.block_size:
            raise ConfigError(
                f"sequence length {time} exceeds block_size={self.config.block_size}; "
                "cut inputs to block_size or build the GPT with a larger block_size"
            )
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        if labels is None:
            return self.lm_head(hidden)  # type: ignore[no-any-return]
        if self.head_chunk_tokens is None:
            return token_loss(self.lm_head(hidden), labels, ignore_index)
        losses_sum, num_tokens = chunked_cross_entropy(
            hidden, self.lm_head, labels, chunk_tokens=self.head_chunk_tokens, ignore_index=ignore_index
        )
        return losses_sum / num_tokens.clamp(min=1), num_tokens


def token_loss(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross entropy over the targets that are not ``ignore_index``, and their count (a tensor).

    ``targets`` are already shifted (targets[t] is the token after input t). With no counted
    target the loss is a zero that still depends on ``logits``, so backward works and adds nothing.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.dtype in (torch.float16, torch.bfloat16):
        flat_logits = flat_logits.float()  # log-softmax in float32 under autocast
    losses_sum = F.cross_entropy(flat_logits, targets.reshape(-1), ignore_index=ignore_index, reduction="sum")
    # The count stays a tensor on the logits' device: reading it here would make the host wait for
    # the device on every micro-batch (the Accumulator reads counts once per window).
    num_tokens = (targets != ignore_index).sum()
    return losses_sum / num_tokens.clamp(min=1), num_tokens
