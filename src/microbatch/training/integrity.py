"""Saved state that proves itself: checksums of the checkpoint's contents and of the run's history.

A checkpoint is written atomically (run_folder.atomic_write), but a bit flipped later, on the disk
or by a copy, inside a tensor leaves a file torch.load reads without a word. So the checkpoint
carries ``checksum``: SHA-256 over everything else in it (every tensor's dtype, shape and bytes;
every other value's type and repr, dict keys in sorted order), computed before saving and checked
after loading. It also carries ``metrics_checksum``: SHA-256 over the metrics records of steps 1 to
its step, as metrics.jsonl holds them, so an edited history (a count changed, a line swapped) is
refused on resume too. A checkpoint without the fields (saved by an older microbatch) is read as
before.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

CHECKSUM_FIELD, METRICS_CHECKSUM_FIELD = "checksum", "metrics_checksum"
_SEALS = (CHECKSUM_FIELD,)


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"V{type(value).__name__}:{value!r};".encode())


def state_checksum(state: dict[str, Any]) -> str:
    """SHA-256 of a checkpoint's contents, its own checksum field left out."""
    digest = hashlib.sha256()
    _feed(digest, {key: value for key, value in state.items() if key not in _SEALS})
    return digest.hexdigest()


def metrics_checksum(records: list[dict[str, Any]]) -> str:
    """SHA-256 of metrics records, each as its JSON line (keys sorted)."""
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record, sort_keys=True).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def seal(state: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """``state`` with the checksums of itself and of the history ``records`` it covers."""
    sealed = {**state, METRICS_CHECKSUM_FIELD: metrics_checksum(records)}
    sealed[CHECKSUM_FIELD] = state_checksum(sealed)
    return sealed


def checksum_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with a loaded checkpoint's checksum; None when it matches (or there is none)."""
    saved = state.get(CHECKSUM_FIELD)
    if saved is None:
        return None
    if not isinstance(saved, str) or saved != state_checksum(state):
        return "its contents do not match the checksum saved with them (damaged after it was written)"
    return None


def metrics_problem(state: dict[str, Any], records: list[dict[str, Any]]) -> str | None:
    """What is wrong with the history read back for a checkpoint; None when it matches (or unknown)."""
    saved = state.get(METRICS_CHECKSUM_FIELD)
    if saved is None or saved == metrics_checksum(records):
        return None
    return "its lines do not match the checksum the checkpoint saved of them (the file was edited or damaged)"
