"""What ``cached_backward`` / ``cached_loss`` / ``cached_representations`` check of their arguments."""

from __future__ import annotations

from .. import distributed
from ..errors import ConfigError
from .cached_tokens import check_split

__all__ = ["check_arguments", "should_gather"]


def check_arguments(
    encode: object,
    loss: object,
    micro_batch_size: object,
    *,
    max_tokens: object = None,
    gather: bool | None = None,
) -> None:
    if not callable(encode):
        raise ConfigError(
            f"encode must be a callable micro_batch -> representations, got {type(encode).__name__}"
        )
    if not callable(loss):
        raise ConfigError(
            f"loss must be a callable representations -> scalar loss, got {type(loss).__name__}"
        )
    if max_tokens is not None or micro_batch_size is None:  # by tokens (accumulate/cached_tokens.py)
        check_split(micro_batch_size, max_tokens, gather=should_gather(gather))
        return
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ConfigError(
            f"micro_batch_size must be an integer >= 1 (samples per encode pass), got {micro_batch_size!r}"
        )


def should_gather(gather: bool | None) -> bool:
    if gather is None:
        return distributed.is_initialized() and distributed.world_size() > 1
    if gather and not distributed.is_initialized():
        raise ConfigError("gather=True needs an initialised torch.distributed process group (torchrun)")
    return bool(gather)
