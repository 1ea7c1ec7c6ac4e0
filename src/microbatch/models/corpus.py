"""The embedded corpus: the Python standard library's own source, read as bytes.

Nothing is downloaded: the documents are the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
on this machine, walked in sorted order (site-packages and ``__pycache__`` always skipped, test
directories skipped unless asked), read until ``max_bytes``. Each file goes to validation when a
hash of its relative path falls below ``validation_fraction``, so the split is the same on every
run and does not move when the byte cap changes; each split reads up to its share of the cap.

``ByteBatches`` samples variable-length chunks of documents (so micro-batches carry different
token counts) into fixed-width, padded ``{"input_ids", "labels"}`` batches, from its own seeded
torch.Generator; its state_dict() makes a resumed run draw the same batches.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError

DEFAULT_MAX_BYTES = 4_000_000
IGNORE_INDEX = -100
PAD_TOKEN = 0
_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRECTORIES = frozenset({"test", "tests", "idle_test"})


@dataclass(frozen=True)
class Corpus:
    """Training and validation documents (bytes), with their paths relative to ``root``."""

    root: str
    train: tuple[bytes, ...]
    validation: tuple[bytes, ...]
    train_paths: tuple[str, ...]
    validation_paths: tuple[str, ...]

    @property
    def train_bytes(self) -> int:
        return sum(len(document) for document in self.train)

    @property
    def validation_bytes(self) -> int:
        return sum(len(document) for document in self.validation)

    def __str__(self) -> str:
        return (
            f"stdlib corpus at {self.root}: {len(self.train)} training files ({self.train_bytes:,} bytes), "
            f"{len(self.validation)} validation files ({self.validation_bytes:,} bytes)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "train_files": len(self.train),
            "train_bytes": self.train_bytes,
            "validation_files": len(self.validation),
            "validation_bytes": self.validation_bytes,
        }


def _is_validation(relative_path: str, fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _source_files(root: str, *, include_tests: bool) -> list[str]:
    paths: list[str] = []
    for directory, subdirectories, files in os.walk(root):
        skipped = _SKIPPED_DIRECTORIES if include_tests else _SKIPPED_DIRECTORIES | _TEST_DIRECTORIES
        subdirectories[:] = sorted(name for name in subdirectories if name not in skipped)
        paths.extend(os.path.join(directory, name) for name in sorted(files) if name.endswith(".py"))
    return paths


@functools.lru_cache(maxsize=8)
def load_corpus(
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    validation_fraction: float = 0.05,
    include_tests: bool = False,
    root: str | None = None,
) -> Corpus:
    """Read the standard library's ``.py`` files (up to ``max_bytes``) and split them by file."""
    if max_bytes < 1:
        raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
    if not 0.0 < validation_fraction < 1.0:
        raise ConfigError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    root = root if root is not None else sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise ConfigError(f"corpus root {root!r} is not a directory")
    # Each split has its own share of the byte cap, so validation gets about validation_fraction
    # of the bytes however the hash happens to fall on the first files.
    validation_budget = max(1, int(max_bytes * validation_fraction))
    budgets = {"train": max_bytes - validation_budget, "validation": validation_budget}
    splits: dict[str, list[tuple[str, bytes]]] = {"train": [], "validation": []}
    used = {"train": 0, "validation": 0}
    for path in _source_files(root, include_tests=include_tests):
        if all(used[split] >= budgets[split] for split in budgets):
            break
        relative_path = os.path.relpath(path, root).replace(os.sep, "/")
        split = "validation" if _is_validation(relative_path, validation_fraction) else "train"
        if used[split] >= budgets[split]:
            continue
        try:
            with open(path, "rb") as file:
                document = file.read(budgets[split] - used[split])
        except OSError:
            continue
        if len(document) >= 2:
            used[split] += len(document)
            splits[split].append((relative_path, document))
    train, validation = splits["train"], splits["validation"]
    if not validation and len(train) > 1:
        validation.append(train.pop())  # a tiny cap may hash no file into validation
    if not train or not validation:
        raise ConfigError(
            f"the standard library at {root!r} has too little Python source for a corpus "
            f"(read {sum(used.values())} bytes); raise max_bytes"
        )
    return Corpus(
        root=root,
        train=tuple(document for _, document in train),
        validation=tuple(document for _, document in validation),
        train_paths=tuple(path for path, _ in train),
        validation_paths=tuple(path for path, _ in validation),
    )


class ByteBatches:
    """Random document chunks as padded, shifted byte batches; ``batches(b)`` draws b sequences.

    Each sequence is a chunk of one document: its length is drawn uniformly from
    [min_length, block_size] and cut short at the document's end. For a chunk c of n + 1 bytes,
    input_ids[:n] = c[:n] and labels[:n] = c[1:] (the next byte); the rest of the row is padding
    (input 0, label -100), so rows carry different numbers of counted tokens.
    """

    def __init__(
        self,
        documents: tuple[bytes, ...] | list[bytes],
        *,
        block_size: int,
        seed: int = 0,
        min_length: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.min_length = max(1, block_size // 4) if min_length is None else min_length
        if not 1 <= self.min_length <= block_size:
            raise ConfigError(f"min_length must be in [1, block_size={block_size}], got {self.min_length}")
        usable = [document for document in documents if len(document) >= 2]
        if not usable:
            raise ConfigError("ByteBatches needs at least one document of two or more bytes")
        lengths = torch.tensor([len(document) for document in usable], dtype=torch.int64)
        self._data = torch.frombuffer(bytearray(b"".join(usable)), dtype=torch.uint8)
        self._starts = torch.cumsum(lengths, 0) - lengths
        self._lengths = lengths
        # A start position is any byte with at least one byte after it in its document, so a
        # document is drawn with probability proportional to (length - 1).
        self._weights = (lengths - 1).double()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def __call__(self, batch_size: int) -> dict[str, torch.Tensor]:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        generator = self.generator
        documents = torch.multinomial(self._weights, batch_size, replacement=True, generator=generator)
        offsets = (
            torch.rand(batch_size, generator=generator, dtype=torch.float64)
            * (self._lengths[documents] - 1).double()
        ).long()
        lengths = torch.randint(self.min_length, self.block_size + 1, (batch_size,), generator=generator)
        input_ids = torch.full((batch_size, self.block_size), PAD_TOKEN, dtype=torch.long)
        labels = torch.full((batch_size, self.block_size), IGNORE_INDEX, dtype=torch.long)
        for row in range(batch_size):
            document = int(documents[row])
            start = int(self._starts[document]) + int(offsets[row])
            end = int(self._starts[document] + self._lengths[document])
            count = min(int(lengths[row]), end - start - 1)
            chunk = self._data[start : start + count + 1].long()
            input_ids[row, :count] = chunk[:-1]
            labels[row, :count] = chunk[1:]
        self.batches_drawn += 1
        return {"input_ids": input_ids, "labels": labels}

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "generator": self.generator.get_state(),
            "batches_drawn": self.batches_drawn,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def count_tokens(labels: torch.Tensor) -> int:
    """Number of counted (not ignored) labels in a batch."""
    return int((labels != IGNORE_INDEX).sum())
