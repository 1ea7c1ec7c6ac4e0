"""``torch.autocast("cuda", ...)`` on fake CPU tensors, casting as CUDA's autocast casts.

The simulation's tensors claim the CPU. ``torch.autocast("cuda")`` there finds no GPU, warns, and
disables itself: a workload written for CUDA mixed precision was simulated in float32 throughout
(its matmuls priced at the fp32 rate, its activations at 4 bytes). And CPU autocast's op lists are
not CUDA's: CPU autocast keeps softmax, log_softmax, layer_norm, exp, pow, sum in the 16-bit
dtype of their input, where CUDA runs them in float32 (and their outputs are float32).

``simulated_cuda_autocast()`` (entered by profile/device_path.py's ``cuda_path``) makes every
``torch.autocast("cuda", dtype)`` in the ``with`` block, however it is spelled (torch.autocast,
torch.amp.autocast, torch.cuda.amp.autocast, as a decorator), run as CPU autocast in ``dtype``
(CUDA's default, float16, when none is given) plus ``_CudaFloat32Ops``, a TorchFunctionMode for
the ops CUDA's lists run in float32. The lists are aten/src/ATen/autocast_mode.h's
(``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``):

- lower precision on both CPU and CUDA: mm, bmm, addmm, addbmm, baddbmm, matmul, linear, conv*,
  prelu, scaled_dot_product_attention (CPU autocast's own dispatch key casts them, and caches the
  16-bit copies of the weights as CUDA's does);
- float32 on CUDA (inputs cast up): acos, asin, cosh, erfinv, exp, expm1, log, log10, log2, log1p,
  reciprocal, rsqrt, sinh, tan, pow, softplus, layer_norm, group_norm, norm, cosine_similarity,
  the losses (nll_loss, cross_entropy, mse_loss, l1_loss, smooth_l1_loss, huber_loss, kl_div,
  binary_cross_entropy_with_logits, ...), dist, cdist, pdist, renorm, logsumexp;
- float32 output without a cast of the input (``dtype=torch.float32`` passed on): softmax,
  log_softmax, sum, prod, cumsum, cumprod, linalg.vector_norm, linalg.matrix_norm.

Differences left: CPU autocast's own float32 list also holds ops CUDA runs in 16 bits (3-D
pooling, padding, some linear algebra), and CUDA's lower-precision list has mv, addmv, addr and
the RNN cells, which CPU autocast does not cast. Transformer training runs none of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.amp import autocast_mode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

FLOAT32_OPS = frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "rpow",
        "float_power",
        "softplus",
        "layer_norm",
        "group_norm",
        "norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "cross_entropy",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
    }
)
FLOAT32_OUTPUT_OPS = frozenset(
    {
        "softmax",
        "log_softmax",
        "sum",
        "prod",
        "cumsum",
        "cumprod",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "vector_norm",
        "matrix_norm",
    }
)


def op_name(func: Any) -> str:
    """The op's name as autocast's lists spell it: ``Tensor.__pow__`` is pow, ``__rpow__`` rpow."""
    name = str(getattr(func, "__name__", ""))
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


def _eligible(value: Any) -> bool:
    # autocast casts floating tensors other than float64 (autocast_mode.h, is_eligible)
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _to_float32(value: Any) -> Any:
    return value.float() if _eligible(value) and value.dtype != torch.float32 else value


class _CudaFloat32Ops(TorchFunctionMode):
    """CUDA autocast's float32 ops (the module docstring), while CPU autocast is enabled."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        name = op_name(func)
        if torch.is_autocast_enabled("cpu") and not name.endswith("_"):  # in-place ops are not cast
            if name in FLOAT32_OPS:
                with torch.autocast("cpu", enabled=False):
                    return func(*tree_map(_to_float32, args), **tree_map(_to_float32, kwargs))
            if name in FLOAT32_OUTPUT_OPS and args and _eligible(args[0]) and kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float32
        return func(*args, **kwargs)


@contextlib.contextmanager
def simulated_cuda_autocast() -> Iterator[None]:
    """``torch.autocast("cuda", ...)`` as CPU autocast with CUDA's lists, for the ``with`` block."""
    cls: Any = autocast_mode.autocast
    init, enter, exit_ = cls.__init__, cls.__enter__, cls.__exit__

    def patched_init(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if device_type == "cuda":
            dtype = dtype if dtype is not None else torch.get_autocast_dtype("cuda")
            self._simulated_cuda = True
            device_type = "cpu"
        init(self, device_type, dtype, enabled, cache_enabled)

    def patched_enter(self: Any) -> Any:
        result = enter(self)
        if getattr(self, "_simulated_cuda", False):
            _regions.append(True)
            if self._enabled:
                mode = _CudaFloat32Ops()
                mode.__enter__()
                self._simulated_mode = mode
        return result

    def patched_exit(self: Any, *exc: Any) -> Any:
        mode = self.__dict__.pop("_simulated_mode", None)
        if mode is not None:
            mode.__exit__(*exc)
        if getattr(self, "_simulated_cuda", False) and _regions:
            _regions.pop()
        return exit_(self, *exc)

    cls.__init__, cls.__enter__, cls.__exit__ = patched_init, patched_enter, patched_exit
    _active.append(True)
    try:
        with _cuda_queries():
            yield
    finally:
        _active.pop()
        cls.__init__, cls.__enter__, cls.__exit__ = init, enter, exit_


_active: list[bool] = []
_regions: list[bool] = []  # simulated torch.autocast("cuda") regions entered and not yet left


@contextlib.contextmanager
def _cuda_queries() -> Iterator[None]:
    """``torch.is_autocast_enabled("cuda")`` and the CUDA autocast dtype, inside a simulated CUDA
    region, answer with the CPU autocast that stands for it (code that checks before it casts)."""
    is_enabled, get_dtype, get_gpu_dtype = (
        torch.is_autocast_enabled,
        torch.get_autocast_dtype,
        torch.get_autocast_gpu_dtype,
    )

    def is_autocast_enabled(device_type: str | None = None) -> bool:
        if device_type in (None, "cuda"):  # no argument: CUDA's (torch's own default)
            return bool(_regions) and is_enabled("cpu")
        return is_enabled(device_type)

    def get_autocast_dtype(device_type: str) -> torch.dtype:
        return get_dtype("cpu" if device_type == "cuda" and _regions else device_type)

    def get_autocast_gpu_dtype() -> torch.dtype:
        return get_dtype("cpu") if _regions else get_gpu_dtype()

    patched: Any = torch
    patched.is_autocast_enabled = is_autocast_enabled
    patched.get_autocast_dtype = get_autocast_dtype
    patched.get_autocast_gpu_dtype = get_autocast_gpu_dtype
    try:
        yield
    finally:
        patched.is_autocast_enabled = is_enabled
        patched.get_autocast_dtype = get_dtype
        patched.get_autocast_gpu_dtype = get_gpu_dtype


def simulating_cuda() -> bool:
    """Whether a simulation for a CUDA device is running: ``torch.autocast("cuda")`` is honoured."""
    return bool(_active)
