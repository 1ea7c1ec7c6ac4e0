"""A roofline time model per aten op, and collective communication times; no device needed.

Each op that computes (not a view or a metadata op) costs

    seconds = max(flops / achieved_rate(op class, dtype), bytes_moved / achieved_bandwidth) + launch_floor

FLOPs come from torch's own formulas (``torch.utils.flop_counter``, the registry FlopCounterMode
uses: matmuls, convolutions, attention); ops without a formula are taken as bandwidth-bound.
``bytes_moved`` is what the op reads and writes: the bytes of its tensor inputs and outputs.

The rates are what kernels achieve, not the data sheet's peaks (``DeviceSpec``'s achieved rates,
issue 20), by op class:

- dense matmuls and convolutions, and grouped GEMMs (``aten._grouped_mm``: transformers' default
  MoE experts, one GEMM per expert over its routed rows): the matmul peak for the op's dtype (TF32
  for float32 when allowed) times the device's ``matmul_efficiency``. A grouped GEMM's FLOPs are
  the routed rows' whatever the routing, and it is priced at the dense rate: an expert with few rows
  runs below it, which this does not model;
- fused attention (SDPA's flash, memory-efficient and cuDNN kernels, forward and backward, and the
  CPU flash kernel the simulation's fake tensors dispatch to): the device's achieved attention
  FLOP/s. A causal kernel skips the masked half of the scores, and FlashAttention's published
  rates count causal FLOPs as half, so torch's full-square formula is halved for causal calls;
- everything else (elementwise, norms, reductions, copies, the optimizer's foreach ops):
  memory-bound, its bytes over the achieved bandwidth (``memory_efficiency`` of the peak).

What remains optimistic: kernels on small shapes run below the large-matmul rate, and the
launch floor is the only per-op overhead (no CPU-side dispatch stalls).

``RooflineClock`` is a dispatch mode that adds up these seconds as ops run (under FakeTensorMode
too, which runs no kernel), so a simulated forward and backward read a clock as a real one reads
``time.perf_counter``.

Collectives (ring algorithms, the bandwidth term only) for W ranks and a message of n bytes at
NCCL's bus bandwidth B (nccl-tests' busbw, ``DeviceSpec.collective_bytes_per_second``, which
already folds in the protocol overhead and, past one node, the network): all-reduce
2 (W - 1) / W * n / B; all-gather and reduce-scatter (W - 1) / W * n / B, where n is the full
(unsharded) size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..memory.device_specs import DeviceSpec
from ..trees.batches import op_tensors

# Ops that move no data although their schema does not say "view".
_FREE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten._unsafe_view.default,
}


def tensor_bytes(tree: Any) -> int:
    """Bytes of the elements the tensors in ``tree`` hold (views count what they see)."""
    return sum(t.numel() * t.element_size() for t in op_tensors(tree))


def _cpu_attention_flops(query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    # QK^T and PV: two batched matmuls, 4 b h s_q s_k d (torch's sdpa_flop_count)
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *_: Any, **__: Any) -> int:
    # the scores QK^T recomputed, then dV, dP, dQ, dK: five batched matmuls (torch's formula)
    return int(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))


def grouped_mm_flops(mat_a: Any, mat_b: Any, *_: Any, **__: Any) -> int:
    """A grouped GEMM (``aten._grouped_mm``, transformers' default MoE experts): one GEMM per expert,
    the experts' rows (2D x 3D, the forward), columns (3D x 2D) or contraction (2D x 2D, the weight
    gradient) split by ``offs``. Together the groups tile one m x k by k x n product, 2 m k n FLOPs,
    whatever the split (the routing); 3D x 3D is a batched GEMM, the batch times that."""
    m, k, n = int(mat_a.shape[-2]), int(mat_a.shape[-1]), int(mat_b.shape[-1])
    batch = int(mat_a.shape[0]) if mat_a.dim() == 3 and mat_b.dim() == 3 else 1
    return 2 * batch * m * k * n


# Ops that torch's FLOP registry does not know but fake CPU tensors dispatch: SDPA on the CPU (the
# simulation's fake tensors claim the CPU) runs as these, and would be priced as free; torch's
# registry has no grouped GEMM either (torch 2.13), which would be priced as a copy.
_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _FORMULAS[torch.ops.aten._grouped_mm] = grouped_mm_flops


_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)
# Fused attention kernels (the packets this torch build has), priced at the attention rate.
ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in _ATTENTION_NAMES if hasattr(torch.ops.aten, name)
)


def is_causal_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an attention op was called with ``is_causal=True`` (read by the op's schema)."""
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [argument.name for argument in func._schema.arguments]
    if "is_causal" not in names:
        return False
    index = names.index("is_causal")
    return bool(args[index]) if index < len(args) else False


def op_class(func: Any, flops: int) -> str:
    """ "attention" (a fused attention kernel), "matmul" (an op with a FLOP formula) or "memory"."""
    if getattr(func, "_overloadpacket", None) in ATTENTION_OPS:
        return "attention"
    return "matmul" if flops else "memory"


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one aten op by torch's formulas (and _FORMULAS'); 0 for ops without one."""
    packet = getattr(func, "_overloadpacket", None)
    own = _FORMULAS.get(packet)
    if own is not None:
        return int(own(*args, **kwargs))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except (TypeError, ValueError, AssertionError, RuntimeError, AttributeError):
        return 0  # an overload the formula does not describe: bandwidth-bound


def _dtype(args: tuple[Any, ...], out: Any) -> torch.dtype:
    for tensor in (*op_tensors(args), *op_tensors(out)):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


class RooflineClock(TorchDispatchMode):
    """Adds each op's roofline seconds to ``seconds`` (and its FLOPs to ``flops``) as ops run."""

    def __init__(self, spec: DeviceSpec, *, tf32: bool = False) -> None:
        super().__init__()
        self.spec, self.tf32 = spec, tf32
        self.seconds = 0.0
        self.flops = 0
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.seconds += self.op_seconds(func, args, kwargs, out)
        return out

    def op_seconds(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> float:
        """The roofline seconds of one op; 0 for views and ops that move no data."""
        in_place = str(getattr(func, "_overloadpacket", "")).endswith("_")  # _foreach_add_ returns None
        if func in _FREE or getattr(func, "is_view", False) or not (op_tensors(out) or in_place):
            return 0.0  # views, and metadata queries (device, sizes) that return no tensor
        # An in-place foreach op returns nothing but writes its first argument back.
        written = tensor_bytes(out) if op_tensors(out) else tensor_bytes(args[:1])
        moved = tensor_bytes(args) + tensor_bytes(kwargs) + written
        if moved == 0:
            return 0.0
        flops = op_flops(func, args, kwargs, out)
        self.flops += flops
        self.ops += 1
        kind = op_class(func, flops)
        dtype = _dtype(args, out)
        compute = 0.0
        if kind == "attention":
            # FlashAttention's rates count a causal call's FLOPs as half (the masked half is skipped).
            work = flops / 2 if is_causal_call(func, args, kwargs) else flops
            compute = work / self.spec.attention_flops(dtype, tf32=self.tf32)
        elif kind == "matmul":
            compute = flops / self.spec.matmul_flops(dtype, tf32=self.tf32)
        memory = moved / self.spec.achieved_memory_bytes_per_second
        return max(compute, memory) + self.spec.launch_seconds


def all_reduce_seconds(message_bytes: float, world_size: int, spec: DeviceSpec) -> float:
    """Ring all-reduce of ``message_bytes`` across ``world_size`` ranks (bandwidth term)."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * message_bytes / spec.collective_bytes_per_second(world_size)


def all_gather_seconds(message_bytes: float, world_size: int, spec: DeviceSpec) -> float:
    """Ring all-gather (or reduce-scatter) whose full, unsharded result is ``message_bytes``."""
    if world_size <= 1:
        return 0.0
    return (world_size - 1) / world_size * message_bytes / spec.collective_bytes_per_second(world_size)
