"""The loss head as a plan choice: no chunks, or chunks of c tokens (checkpointing/head.py).

The head's logits (tokens x vocabulary, and their float32 copies and gradients) can outweigh every
block's activations; in chunks of c tokens at most c x vocabulary of them are alive (a plain linear
head makes its gradients chunk by chunk in forward, linear_loss.py; another head recomputes each
chunk in backward). Small chunks run more, smaller kernels, so each is priced the way the blocks are:
the workload is profiled (or simulated) with the head chunked, and the search over sizes and
policies runs on each profile (by default, ``head=None``, only when no plan fits without chunks;
``head=[c, ...]`` prices them always). A head with a plan that fits beats one without; among those
whose best plan is within HEAD_TIME_SHARE (or the profile's timing noise) of the fastest, the one
whose best plan needs least memory is chosen; when none fits, the one whose smallest plan needs
least; no chunks on a tie. While the rest of planning runs (the step lever, the trial) the chosen
head stays installed on the model; it is removed when plan() returns, and ``plan.apply`` /
``fit_trainer`` install it from the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence

from ...checkpointing.head import chunk_head, head_module
from ...errors import ConfigError
from ..outcome import PlanRequest, Setup
from ..search.sizes import search

logger = logging.getLogger("microbatch.planner.planning")

AUTO_HEAD_CHUNKS = (256, 1024, 4096)  # TRL's chunked_nll (PR #5575) takes 256; torchtitan's #996 ~1,000
# A chunked head whose best plan is at most this much slower than the fastest is taken when it needs
# less memory (the bound: torchtitan's chunked loss saved 7.3 GiB at unchanged tokens/s).
HEAD_TIME_SHARE = 0.01
# Chunk the head by default only where the logits dominate: a vocabulary at least this many times the
# model's width (Llama 3: 128,256 / 4,096 = 31; GPT-2: 50,257 / 768 = 65; a byte-level GPT: 2).
AUTO_VOCAB_PER_WIDTH = 16


def head_sizes(setup: Setup, wanted: Sequence[int] | None) -> tuple[int, ...]:
    """The tokens per chunk to price: ``wanted``, or AUTO_HEAD_CHUNKS where the logits dominate."""
    head = head_module(setup.workload.model)
    if wanted is not None:
        if wanted and head is None:
            raise ConfigError(
                f"head={list(wanted)}: {type(setup.workload.model).__name__} has no loss head microbatch can "
                "chunk (the built-in GPT, transformers causal LMs); leave head out"
            )
        return tuple(wanted)
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        return ()
    vocabulary, width = weight.shape
    return AUTO_HEAD_CHUNKS if vocabulary >= AUTO_VOCAB_PER_WIDTH * width else ()


def _rank(setup: Setup) -> tuple[bool, float, float]:
    """(no plan fits, the best plan's seconds per step or inf, its peak or the smallest plan's).

    Without the optimizer step's temporaries: they are the same under every head, and the step's own
    lever (step_choice.py, after this one) can remove them; were they counted, a step that binds would
    hide what the head saves.
    """
    result = search(
        dataclasses.replace(setup.profile, step_peak_bytes=0),
        per_rank_batch=setup.per_rank_batch,
        capacity_bytes=setup.model_budget_bytes,
        bytes_per_sample=setup.bytes_per_sample,
        **setup.rules.search_options(),
    )
    if result.best is None:
        return True, math.inf, float(result.minimum.peak_bytes)
    return False, result.best.seconds_per_step, float(result.best.peak_bytes)


def _choose(ranks: dict[int | None, tuple[bool, float, float]], noise: float) -> int | None:
    """The head to plan with (None: no chunks), from each head's rank (see the module docstring)."""
    fitting = {tokens: rank for tokens, rank in ranks.items() if not rank[0]}
    if not fitting:  # the one whose smallest plan needs least; no chunks on a tie
        return min(ranks, key=lambda tokens: (ranks[tokens][2], tokens is not None))
    fastest = min(rank[1] for rank in fitting.values())
    # Within the timing noise and HEAD_TIME_SHARE of the fastest, the least memory: a chunked head
    # costs at most that share of the step and frees the rest of the budget.
    near = [t for t, rank in fitting.items() if rank[1] <= fastest * (1 + max(2 * noise, HEAD_TIME_SHARE))]
    return min(near, key=lambda tokens: (fitting[tokens][2], tokens is not None))


@contextlib.contextmanager
def chosen_head(
    setup: Setup, request: PlanRequest, prepare: Callable[[PlanRequest], Setup]
) -> Iterator[Setup]:
    """The setup with the chosen head, the head installed on the model for the ``with`` block."""
    options = request.options
    given = options.profile is not None
    chunkable = options.exact_levers and (not given or options.head_profile is not None)
    sizes = head_sizes(setup, options.head) if chunkable else ()
    model = setup.workload.model
    ranks: dict[int | None, tuple[bool, float, float]] = {None: _rank(setup)}
    candidates: dict[int | None, Setup] = {None: setup}
    if options.head is None and not ranks[None][0]:
        sizes = ()  # auto: priced only when no plan fits without chunks (plans that fit stay as they were)
    for tokens in sizes:
        handle = chunk_head(model, tokens=tokens)
        try:
            chunked = options
            if given and options.head_profile is not None:
                chunked = dataclasses.replace(options, profile=options.head_profile(tokens))
            candidate = prepare(dataclasses.replace(request, workload=setup.workload, options=chunked))
        finally:
            handle.remove()
        ranks[tokens] = _rank(candidate)
        candidates[tokens] = dataclasses.replace(candidate, head_chunk_tokens=tokens)
    chosen = _choose(ranks, setup.profile.time_noise)
    best, best_rank = candidates[chosen], ranks[chosen]
    if best.head_chunk_tokens is None:
        if sizes:
            logger.info("planning %s: the loss head without chunks (%s)", model.__class__.__name__, ranks)
        yield best
        return
    note = f"head: chunks of {best.head_chunk_tokens:,} tokens, never all logits alive at once"
    if not best_rank[0] and ranks[None][0]:
        note += " (no plan fits without them)"
    best.notes.append(note)
    handle = chunk_head(model, tokens=best.head_chunk_tokens)
    try:
        yield best
    finally:
        handle.remove()
