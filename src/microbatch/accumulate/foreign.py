"""Another library's gradient accumulation under the Accumulator's: refused, never silently combined.

Accelerate's ``Accelerator(gradient_accumulation_steps=k)`` makes its prepared optimizer's ``step()``
a no-op until k ``accelerator.accumulate()`` passes have gone by (``GradientState.sync_gradients``).
An Accumulator stepping that optimizer at its own window ends would have most of its steps dropped
without a word, and the epoch's short last window's with them (2 of 3 steps, issue 24).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

__all__ = ["refuse_foreign_accumulation"]


def refuse_foreign_accumulation(optimizer: Any) -> None:
    """Raise ConfigError when ``optimizer`` is Accelerate's and Accelerate accumulates too."""
    gradient_state = getattr(optimizer, "gradient_state", None)
    accelerate_steps = getattr(gradient_state, "num_steps", 1)
    if isinstance(accelerate_steps, int) and accelerate_steps > 1:
        raise ConfigError(
            "the optimizer was prepared by an Accelerator with "
            f"gradient_accumulation_steps={accelerate_steps}: it would skip the Accumulator's steps (the "
            "short last window's too). Let one of them accumulate: "
            "Accelerator(gradient_accumulation_steps=1) "
            "with microbatch.Accumulator(steps=...), or Accelerate alone"
        )
