"""Built-in models and data: a byte-level GPT, the stdlib corpus, and a BatchNorm CNN.

May import: ``errors``, ``trees``, ``memory``, ``workload``, and ``checkpointing`` (the chunked loss
head). Nothing here knows of accumulation or planning.
"""

from __future__ import annotations

from .cnn import SmallCNN, load_digits_tensors
from .corpus import ByteBatches, Corpus, load_corpus
from .gpt import GPT, GPT_SIZES, GPTConfig, gpt_config, token_loss

__all__ = [
    "GPT",
    "GPT_SIZES",
    "ByteBatches",
    "Corpus",
    "GPTConfig",
    "SmallCNN",
    "gpt_config",
    "load_corpus",
    "load_digits_tensors",
    "token_loss",
]
