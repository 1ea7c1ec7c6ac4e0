"""Tiny transformers models built from configurations, with random weights, and text to train them on.

Nothing is downloaded: the models come from ``GPT2Config`` / ``LlamaConfig`` / ``BertConfig`` at
tiny sizes (weights drawn under a seed, leaving the global RNG alone), and the text is the Python
standard library's own source, read as bytes (vocabulary 256). These are for tests, examples and
``microbatch plan microbatch.hf:tiny_gpt2_workload``; the same code takes ``from_pretrained`` models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, WorkloadError
from ..models.corpus import ByteBatches, load_corpus
from ..workload import Workload
from .causal_lm import IGNORE_INDEX, causal_lm_workload

__all__ = [
    "StdlibTextBatches",
    "tiny_bert",
    "tiny_gpt2",
    "tiny_gpt2_workload",
    "tiny_llama",
    "tiny_llama_workload",
    "tiny_moe",
]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise WorkloadError(
            "this needs Hugging Face transformers: pip install 'transformers>=4.46' "
            "(from the microbatch checkout: pip install -e '.[hf]')"
        ) from error
    return transformers


def _build(model_class: str, config: Any, *, seed: int, dtype: torch.dtype | None) -> nn.Module:
    """``model_class(config)`` with weights drawn under ``seed``, leaving the global RNG as it was."""
    transformers = _transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = getattr(transformers, model_class)(config)
    if dtype is not None:
        model.to(dtype)
    return model.train()


def tiny_gpt2(
    *,
    vocab_size: int = 256,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_heads: int = 2,
    max_length: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> nn.Module:
    """A GPT2LMHeadModel from a tiny GPT2Config, random weights (``config`` overrides any field)."""
    transformers = _transformers()
    settings = {
        "vocab_size": vocab_size,
        "n_positions": max_length,
        "n_embd": hidden_size,
        "n_layer": num_layers,
        "n_head": num_heads,
        "resid_pdrop": dropout,
        "embd_pdrop": dropout,
        "attn_pdrop": dropout,
        # GPT-2's own ids (50256) lie outside a small vocabulary.
        "bos_token_id": vocab_size - 1,
        "eos_token_id": vocab_size - 1,
        **config,
    }
    model = _build("GPT2LMHeadModel", transformers.GPT2Config(**settings), seed=seed, dtype=dtype)
    if getattr(model, "loss_type", "") is None:
        # transformers 5 finds the loss by class name, which "GPT2LMHeadModel" does not match; it
        # falls back to the causal LM loss with a warning. Name it.
        model.loss_type = "ForCausalLM"  # type: ignore[assignment]
    return model


def tiny_llama(
    *,
    vocab_size: int = 256,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_length: int = 64,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> nn.Module:
    """A LlamaForCausalLM (RMSNorm, rotary positions, grouped-query attention, SwiGLU) from a tiny config."""
    transformers = _transformers()
    settings = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_length,
        **config,
    }
    return _build("LlamaForCausalLM", transformers.LlamaConfig(**settings), seed=seed, dtype=dtype)


MOE_FAMILIES = {  # family -> (model class, config class, the config's name for the expert count)
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", "num_experts"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", "num_local_experts"),
}


def tiny_moe(
    family: str = "qwen3_moe",
    *,
    vocab_size: int = 64,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 16,
    aux_loss_coef: float = 0.01,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> nn.Module:
    """A tiny mixture-of-experts causal LM (``family``: qwen3_moe or mixtral) with the router's aux loss on.

    Experts run transformers' "eager" loop (its default grouped_mm fails in float64 on the CPU).
    """
    if family not in MOE_FAMILIES:
        raise ConfigError(f"family must be one of {sorted(MOE_FAMILIES)}, got {family!r}")
    transformers = _transformers()
    model_class, config_class, experts_key = MOE_FAMILIES[family]
    sizes = {"moe_intermediate_size": expert_size, "intermediate_size": 2 * expert_size}
    if family == "mixtral":
        sizes = {"intermediate_size": expert_size}
    settings = {
        "vocab_size": vocab_size, "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden_size // 4,
        "max_position_embeddings": 128, experts_key: num_experts, "num_experts_per_tok": top_k,
        "output_router_logits": True, "router_aux_loss_coef": aux_loss_coef, "pad_token_id": 0,
        "experts_implementation": "eager", **sizes, **config,
    }  # fmt: skip
    return _build(model_class, getattr(transformers, config_class)(**settings), seed=seed, dtype=dtype)


def tiny_bert(
    *,
    vocab_size: int = 256,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_heads: int = 2,
    max_length: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **config: Any,
) -> nn.Module:
    """A BertForMaskedLM (an encoder: BERT-style blocks under ``bert.encoder.layer``) from a tiny config."""
    transformers = _transformers()
    settings = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": max_length,
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
        **config,
    }
    return _build("BertForMaskedLM", transformers.BertConfig(**settings), seed=seed, dtype=dtype)


class StdlibTextBatches:
    """Byte-level text for a causal LM: chunks of the standard library's source (nothing downloaded).

    Each row is one chunk of 2 to ``max_length`` bytes, right-padded, so rows carry different
    numbers of predicted tokens. Uses the built-in corpus sampler (``models.corpus.ByteBatches``)
    and its seeded generator; its pre-shifted ``(input_ids, labels)`` become the unshifted
    ``input_ids`` / ``labels`` a transformers model shifts itself: for a chunk c of n + 1 bytes,
    input_ids = labels = c and attention_mask covers n + 1 positions (n predicted tokens).
    """

    def __init__(self, *, max_length: int = 64, seed: int = 0, max_bytes: int = 400_000) -> None:
        if max_length < 2:
            raise ConfigError(f"max_length must be >= 2, got {max_length}")
        self.max_length = max_length
        corpus = load_corpus(max_bytes=max_bytes)
        self.description = f"byte chunks of the standard library's source ({corpus.train_bytes:,} bytes)"
        self._chunks = ByteBatches(corpus.train, block_size=max_length - 1, seed=seed, min_length=1)

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        shifted = self._chunks(batch_size)
        counted = shifted["labels"] != IGNORE_INDEX  # n_i leading positions per row
        first = shifted["input_ids"][:, :1]
        tokens = torch.cat([first, shifted["labels"].clamp(min=0)], dim=1)
        attention_mask = torch.cat([torch.ones_like(first), counted.long()], dim=1)
        input_ids = tokens.masked_fill(attention_mask == 0, 0)
        labels = tokens.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _tiny_workload(model: nn.Module, name: str, *, max_length: int) -> Workload:
    batches = StdlibTextBatches(max_length=max_length, seed=0)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    return causal_lm_workload(
        model,
        batches,
        name=name,
        description=f"{name}: transformers model from a tiny config ({millions:.2g}M parameters, random "
        f"weights) on {batches.description}, token-mean loss",
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
    )


def tiny_gpt2_workload() -> Workload:
    """A 4-layer GPT-2 from a tiny config on byte-level stdlib text (for ``microbatch plan``)."""
    return _tiny_workload(
        tiny_gpt2(num_layers=4, hidden_size=64, num_heads=4, max_length=64), "tiny-gpt2", max_length=64
    )


def tiny_llama_workload() -> Workload:
    """A 4-layer Llama-style model from a tiny config on byte-level stdlib text."""
    return _tiny_workload(
        tiny_llama(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, max_length=64),
        "tiny-llama",
        max_length=64,
    )
