"""The errors microbatch raises for things a user can fix.

Every message names the argument that is wrong and says what to do instead.

    MicrobatchError                      base of everything below
    ├── ConfigError(ValueError)          a bad argument: steps=0, items=-3, an unknown policy
    ├── UsageError(RuntimeError)         calls in the wrong order: step() before a window's end
    ├── WorkloadError(ValueError)        a model spec that cannot be loaded or used
    ├── CheckpointError(ValueError)      activation checkpointing asked for something impossible
    ├── InfeasibleBudgetError(ValueError)  no plan fits the memory budget (says the minimum)
    ├── ResumeError(RuntimeError)        a run folder or checkpoint that cannot be resumed
    └── TrainingError(RuntimeError)      a run that cannot go on (all steps skipped, disk full)
"""

from __future__ import annotations


class MicrobatchError(Exception):
    """Base class of microbatch's own errors."""


class ConfigError(MicrobatchError, ValueError):
    """An argument has a value microbatch cannot use."""


class UsageError(MicrobatchError, RuntimeError):
    """An API was called in an order that would lose or corrupt gradients."""


class WorkloadError(MicrobatchError, ValueError):
    """A workload (model, batches, loss) cannot be loaded or run."""


class CheckpointError(MicrobatchError, ValueError):
    """Activation checkpointing cannot be applied as asked."""


class InfeasibleBudgetError(MicrobatchError, ValueError):
    """No plan fits the memory budget.

    ``minimum_bytes`` is the smallest peak any plan reaches; ``parts`` says what it is made of.
    ``minimum_is_lower_bound``: True when ``minimum_bytes`` is only known to be at least that much
    (a check made before measuring the model, or after trials ran out of memory).
    """

    def __init__(
        self,
        message: str,
        *,
        minimum_bytes: int,
        parts: dict[str, int] | None = None,
        minimum_is_lower_bound: bool = False,
    ) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.parts = dict(parts or {})
        self.minimum_is_lower_bound = minimum_is_lower_bound


class ResumeError(MicrobatchError, RuntimeError):
    """A checkpoint or run folder cannot be resumed."""


class TrainingError(MicrobatchError, RuntimeError):
    """A training run cannot go on: every step is skipped, or its checkpoint cannot be written."""


# A note microbatch adds to the user's own error (profile/user_calls.py), and how to read them back.
PLANNING_NOTE_PREFIX = "microbatch: "


def planning_notes(error: BaseException) -> list[str]:
    """The notes microbatch added to ``error`` (what it was doing when the user's code raised it)."""
    notes = getattr(error, "__notes__", None) or []
    size = len(PLANNING_NOTE_PREFIX)
    return [n[size:] for n in notes if isinstance(n, str) and n.startswith(PLANNING_NOTE_PREFIX)]
