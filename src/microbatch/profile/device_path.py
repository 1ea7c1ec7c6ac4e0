"""The code paths a CUDA device takes, for fake tensors that claim to be on the CPU.

The simulation's fake tensors say ``device="cpu"``, and libraries choose their path by device:
left alone, a simulated GPU would run what the CPU runs and keep what the CPU keeps. For a CUDA
target, ``cuda_path()`` puts back the GPU's choices:

- **Kernels** (``cuda_kernels``): dropout and attention as CUDA's fused kernels keep them.
- **Optimizer** (``cuda_optimizer_choice``): ``torch.optim`` picks its implementation in
  ``_default_to_fused_or_foreach`` (torch/optim/optimizer.py): ``foreach`` only when every
  parameter is a plain Tensor on a device of ``_get_foreach_kernels_supported_devices()`` (cuda,
  xpu, mtia: not the CPU) and the user set neither ``foreach`` nor ``fused``. A fake CPU tensor
  fails both, so the step took the per-tensor loop, whose temporaries are one parameter's; the
  foreach path on CUDA makes each temporary for all parameters at once (AdamW's
  ``_foreach_sqrt(exp_avg_sqs)``: the size of all parameters). ``fused=True`` runs as asked
  (fused kernels exist for the CPU too and keep no temporaries).
- **transformers** (``transformers_untraced``): ``transformers.utils.import_utils.is_tracing(t)``
  is True for a FakeTensor, and ``masking_utils`` then takes its tracing path: it cannot read
  whether the position ids are packed (``find_packed_sequence_indices``) or the padding mask
  all ones, so it builds an explicit (b, 1, s, s) mask; with a mask, ``sdpa_attention_forward``
  cannot ask SDPA for grouped-query attention (``use_gqa_in_sdpa``) and repeats K and V per head
  (``repeat_kv``). On a GPU the checks read the values, find one unpadded sequence per row, and
  call SDPA with ``is_causal=True`` and ``enable_gqa=True``: no mask, no copies. Under
  ``transformers_untraced`` fake tensors do not count as tracing, so the checks run, and a fake
  boolean reads as True (profile/simulate.py's ``_FakeScalars``): unpacked, unpadded rows, as a
  training batch of whole sequences is. Compilation, jit and fx tracing still count.
- **Autocast** (profile/cuda_autocast.py): ``torch.autocast("cuda", dtype)`` in the workload runs
  on the fake CPU tensors with CUDA autocast's op lists, where it would disable itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn import functional as F

from .cuda_autocast import simulated_cuda_autocast


@contextlib.contextmanager
def cuda_kernels() -> Iterator[None]:
    """Dropout and attention as CUDA runs them, for the ``with`` block.

    The fake tensors claim to be on the CPU, whose kernels keep other things for backward:

    - ``F.dropout`` on the CPU multiplies by a mask in the input's dtype and saves it (2 bytes per
      element in 16-bit); CUDA's fused kernel (``torch.native_dropout``, what its dropout
      dispatches to) saves a 1-byte boolean mask.
    - ``F.scaled_dot_product_attention`` with dropout falls back on the CPU to the math path, which
      keeps the attention matrix; CUDA's flash and memory-efficient kernels keep only the output,
      the log-sum-exp and the RNG state, as the CPU's flash kernel does without dropout.

    The functions are swapped in ``torch.nn.functional`` (a checkpoint's recompute sees them too).
    """
    dropout, attention = F.dropout, F.scaled_dot_product_attention

    def fused_dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> Any:
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def flash_attention(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs.pop("dropout_p", None)
        if _value_head_differs(*args, **kwargs):
            return _efficient_attention(*args, **kwargs)
        return attention(*args, **kwargs)

    F.dropout, F.scaled_dot_product_attention = fused_dropout, flash_attention
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, attention


def _value_head_differs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None, *_: Any, **__: Any
) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3: queries and keys of 192, values of 128), unmasked
    and one key per query head: CUDA's flash kernel wants one head size and SDPA takes the
    memory-efficient kernel, which keeps the output and the log-sum-exp; the CPU's flash kernel
    refuses it too and the CPU falls back to the math path, which keeps the attention matrix."""
    return value.shape[-1] != query.shape[-1] and attn_mask is None and key.shape[-3] == query.shape[-3]


def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **_: Any,
) -> torch.Tensor:
    """SDPA as CUDA's memory-efficient kernel runs it (the log-sum-exp kept when a gradient is due)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    output: torch.Tensor = efficient(query, key, value, None, needs_grad, 0.0, is_causal, scale=scale)[0]
    return output


def _choice_on_cuda(params: list[Any], differentiable: bool, use_fused: bool = False) -> tuple[bool, bool]:
    """``_default_to_fused_or_foreach`` as it answers for plain tensors on a CUDA device.

    Every device test passes on CUDA, so only the optimizer's own conditions remain: a
    differentiable step takes neither, ``use_fused`` asks for fused when every parameter is
    floating point, and otherwise foreach.
    """
    if torch.jit.is_scripting() or differentiable:
        return False, False
    fused = use_fused and all(p is None or torch.is_floating_point(p) for p in params)
    return fused, not fused


def _swap_in_modules(prefix: str, name: str, original: Any, replacement: Any) -> list[tuple[Any, Any]]:
    """Set ``name`` to ``replacement`` in every loaded module under ``prefix`` that imported ``original``.

    Libraries import helpers by name (``from .optimizer import _default_to_fused_or_foreach``), so
    each importing module holds its own reference. Returns (module, original) pairs to restore.
    """
    swapped = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == prefix or module_name.startswith(prefix + ".")):
            continue
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)
            swapped.append((module, original))
    return swapped


def _restore(swapped: list[tuple[Any, Any]], name: str) -> None:
    for module, original in swapped:
        setattr(module, name, original)


@contextlib.contextmanager
def cuda_optimizer_choice() -> Iterator[None]:
    """``torch.optim``'s default implementation chosen as on CUDA (see the module docstring)."""
    from torch.optim import optimizer

    name = "_default_to_fused_or_foreach"
    swapped = _swap_in_modules("torch.optim", name, getattr(optimizer, name), _choice_on_cuda)
    try:
        yield
    finally:
        _restore(swapped, name)


@contextlib.contextmanager
def transformers_untraced() -> Iterator[None]:
    """transformers' masks built as on a GPU: fake tensors do not count as tracing (module docstring).

    Nothing changes when transformers is not imported.
    """
    import_utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(import_utils, "is_tracing", None)
    if import_utils is None or original is None:
        yield
        return
    fx_proxy, jax_jitting = import_utils.is_torch_fx_proxy, import_utils.is_jax_jitting

    def is_tracing(tensor: Any = None) -> bool:
        # transformers' is_tracing less its is_fake_tensor(tensor) term
        traced = bool(original())
        if tensor is not None:
            traced = traced or bool(fx_proxy(tensor)) or bool(jax_jitting(tensor))
        return traced

    swapped = _swap_in_modules("transformers", "is_tracing", original, is_tracing)
    try:
        yield
    finally:
        _restore(swapped, "is_tracing")


@contextlib.contextmanager
def cuda_path() -> Iterator[None]:
    """Kernels, optimizer, transformers' masks and autocast as on a CUDA device, for the ``with`` block."""
    with cuda_kernels(), cuda_optimizer_choice(), transformers_untraced(), simulated_cuda_autocast():
        yield
