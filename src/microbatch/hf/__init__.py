"""Hugging Face transformers models under microbatch (``pip install -e '.[hf]'`` in the checkout).

``causal_lm_workload(model, batches)`` makes a Workload whose loss is the model's own token mean
with the count of shifted labels it averages over, so the Accumulator, ``verify`` and the planner
treat a transformers causal LM exactly (see ``causal_lm``). ``tiny_gpt2`` / ``tiny_llama`` /
``tiny_bert`` build small models from configurations (see ``tiny``). ``fit_trainer(trainer, batch=...,
memory=...)`` plans for a transformers Trainer and sets its batch size, accumulation and
checkpointing, and weights the Trainer's loss by the window's items so its accumulation is
exact on every architecture (``exact_loss_weighting``, see ``weighting``). Importing this package
does not import transformers; building a model does. ``CachedSentenceLoss`` wraps a sentence-transformers
in-batch-negatives loss with gradient caching (see ``sentence``).

May import every layer up to the ``planner`` and ``models``; never ``training`` or ``commands``.
"""

from __future__ import annotations

from .causal_lm import (
    IGNORE_INDEX,
    causal_lm_loss,
    causal_lm_workload,
    check_causal_lm_loss,
    count_causal_lm_items,
    pad_causal_lm_batch,
)
from .moe import exact_router_balance, moe_routing
from .sentence import CachedSentenceLoss, trim_padding
from .tiny import (
    StdlibTextBatches,
    tiny_bert,
    tiny_gpt2,
    tiny_gpt2_workload,
    tiny_llama,
    tiny_llama_workload,
    tiny_moe,
)
from .trainer import fit_trainer, trainer_workload
from .weighting import count_items_rule, exact_loss_weighting

__all__ = [
    "IGNORE_INDEX",
    "CachedSentenceLoss",
    "StdlibTextBatches",
    "causal_lm_loss",
    "causal_lm_workload",
    "check_causal_lm_loss",
    "count_causal_lm_items",
    "count_items_rule",
    "exact_loss_weighting",
    "exact_router_balance",
    "fit_trainer",
    "moe_routing",
    "pad_causal_lm_batch",
    "tiny_bert",
    "tiny_gpt2",
    "tiny_gpt2_workload",
    "tiny_llama",
    "tiny_llama_workload",
    "tiny_moe",
    "trainer_workload",
    "trim_padding",
]
