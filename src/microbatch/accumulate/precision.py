"""Low precision: gradients accumulated in a wider dtype, and the precision a workload computes in.

Accumulating N micro-batch gradients into a bfloat16 ``.grad`` rounds N times to 8 bits of
mantissa: the error grows with N (about sqrt(N) * 2^-9 relative for random rounding errors, N * 2^-9
when they align), while the full batch's gradient is rounded once. ``WideGradients`` moves each
micro-batch's gradient into a float32 sum as soon as autograd has written it (a post-accumulate-grad
hook), so the window's sum is rounded to the parameter's dtype once, at ``step()``, after the
division by the window's item count. Megatron-LM (``main_grad``) and DeepSpeed (fp32 gradient
accumulation for bf16) do the same. Cost: 4 bytes per low-precision parameter for the float32 sum,
while the low-precision ``.grad`` is freed between micro-batches (measured in
tests/test_precision.py and benchmarks).

``compute_dtype``: autocast (or a model that casts inside) computes matmuls in bfloat16 / float16
while its parameters stay float32. A comparison of gradients is then only as sharp as the compute
dtype; verify picks its tolerance from it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError

__all__ = ["WideGradients", "compute_dtype", "with_autocast"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_MATMUL_NAMES = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "_convolution", "linear"}
)


class WideGradients:
    """Sum low-precision parameters' gradients in ``dtype`` across a window's micro-batches."""

    def __init__(self, params: Iterable[nn.Parameter], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.params = wide_parameters(params, dtype)
        self.sums: dict[int, torch.Tensor] = {}
        me = weakref.ref(self)  # the hooks must not keep a discarded accumulator's sums alive

        def take(param: torch.Tensor) -> None:
            owner = me()
            if owner is not None:
                owner._take(param)

        handles = [p.register_post_accumulate_grad_hook(take) for p in self.params]
        self._remove = weakref.finalize(self, _remove, handles)

    def remove_hooks(self) -> None:
        """Remove the hooks now (Accumulator.close); gradients then stay in ``.grad`` as usual."""
        self._remove()
        self.sums.clear()

    def _take(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        total = self.sums.get(id(param))
        if total is None:
            self.sums[id(param)] = grad.to(self.dtype, copy=True)
        else:
            total.add_(grad)  # in the wide dtype: bf16 + fp32 promotes to fp32
        param.grad = None  # the next backward writes a fresh low-precision gradient

    def restore_(self, factor: float) -> set[int]:
        """Each covered parameter's ``.grad`` = (its wide sum * factor), rounded once; ids restored."""
        restored = set()
        for param in self.params:
            total = self.sums.pop(id(param), None)
            if total is None:
                continue
            if factor != 1.0:
                total.mul_(factor)
            param.grad = total.to(param.dtype)
            restored.add(id(param))
        return restored

    @property
    def extra_bytes(self) -> int:
        """Bytes of the wide sums (held from a window's first backward to its step)."""
        return sum(p.numel() * torch.finfo(self.dtype).bits // 8 for p in self.params)


def wide_parameters(params: Iterable[nn.Parameter], dtype: torch.dtype) -> list[nn.Parameter]:
    """The trainable floating parameters narrower than ``dtype``: those WideGradients hooks."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"accumulate_dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}"
        )
    width = torch.finfo(dtype).bits
    return [
        p for p in params if p.requires_grad and p.is_floating_point() and torch.finfo(p.dtype).bits < width
    ]


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name in _MATMUL_NAMES and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.dtypes.add(out.dtype)
        return out


def compute_dtype(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], batch: Any
) -> torch.dtype | None:
    """The low-precision dtype the workload's matmuls compute in, when below the parameters' dtype.

    One forward of ``loss_fn(model, batch)`` without gradients, watching matmul-like ops' outputs.
    None when every matmul runs at (or above) the parameters' precision.
    """
    parameter_bits = max(
        (torch.finfo(p.dtype).bits for p in model.parameters() if p.is_floating_point()), default=32
    )
    recorder = _MatmulDtypes()
    with torch.no_grad(), recorder:
        loss_fn(model, batch)
    low = [dtype for dtype in recorder.dtypes if torch.finfo(dtype).bits < parameter_bits]
    return min(low, key=lambda dtype: (torch.finfo(dtype).bits, str(dtype))) if low else None


def with_autocast(
    loss_fn: Callable[[nn.Module, Any], Any], device_type: str, dtype: torch.dtype
) -> Callable[[nn.Module, Any], Any]:
    """``loss_fn`` run under ``torch.autocast(device_type, dtype)``."""
    if dtype not in _LOW_PRECISION:
        raise ConfigError(f"autocast must be torch.bfloat16 or torch.float16, got {dtype!r}")

    def autocast_loss(model: nn.Module, batch: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return loss_fn(model, batch)

    return autocast_loss


def low_precision_parameters(params: Iterator[nn.Parameter]) -> torch.dtype | None:
    """The lowest-precision floating dtype among trainable parameters, when it is below float32."""
    low = {p.dtype for p in params if p.requires_grad and p.dtype in _LOW_PRECISION}
    return min(low, key=lambda dtype: (torch.finfo(dtype).bits, str(dtype))) if low else None
