"""Recognising an out-of-memory failure, and freeing what it left behind.

One place for "did this run out of memory?", shared by the profiler, the planner's trial and the
training loop, so that every caller treats the same failures as an OOM.

Recognised, in this order:

- the exception type: ``torch.OutOfMemoryError`` (CUDA, MPS, XPU caching allocators raise it) and
  Python's ``MemoryError`` (a host allocation that failed);
- the failures of libraries that allocate on the device behind the caching allocator's back, which
  torch re-raises as a plain RuntimeError (or ``torch.distributed.DistBackendError``) carrying the
  library's status name: cuBLAS ``CUBLAS_STATUS_ALLOC_FAILED``, cuDNN
  ``CUDNN_STATUS_ALLOC_FAILED`` / ``CUDNN_STATUS_NOT_ENOUGH_WORKSPACE`` / ``CUDNN_STATUS_BAD_ALLOC``,
  cuFFT ``CUFFT_ALLOC_FAILED``, cuSOLVER ``CUSOLVER_STATUS_ALLOC_FAILED``, cuSPARSE
  ``CUSPARSE_STATUS_ALLOC_FAILED``, the CUDA runtime's ``cudaErrorMemoryAllocation``, and NCCL's
  ``ncclSystemError`` / ``ncclInternalError`` when its message says the allocation failed (NCCL
  reports "Cuda failure 'out of memory'" or "Failed to CUDA calloc");
- the text torch itself uses: "out of memory", and the CPU allocator's "can't allocate memory".

Only exceptions are examined, and errors are never swallowed here: callers decide.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")
# Status names that mean "the library could not allocate device memory" (cuBLAS, cuDNN, cuFFT,
# cuSOLVER, cuSPARSE, the CUDA runtime), matched case-sensitively as the libraries print them.
ALLOCATION_STATUS_NAMES = (
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_BAD_ALLOC",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "CUFFT_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
)
# NCCL reports an allocation failure as a system or internal error whose text names it.
_NCCL_STATUS_NAMES = ("ncclSystemError", "ncclInternalError", "ncclUnhandledCudaError")
_ALLOCATION_PHRASES = ("out of memory", "can't allocate memory", "failed to cuda calloc", "cudamalloc failed")


def is_out_of_memory(error: BaseException) -> bool:
    """True for an out-of-memory failure on any device; see the module docstring for what counts."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):  # DistBackendError is a RuntimeError
        return False
    text = str(error)
    if any(name in text for name in ALLOCATION_STATUS_NAMES):
        return True
    lowered = text.lower()
    if any(phrase in lowered for phrase in _ALLOCATION_PHRASES):
        return True
    return any(name in text for name in _NCCL_STATUS_NAMES) and "alloc" in lowered


def free_memory(device: torch.device) -> None:
    """Collect garbage and hand cached device memory back after an out-of-memory error."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attempt(run: Callable[[], T], device: torch.device) -> T | None:
    """``run()``'s result, or None when it ran out of memory (then memory is freed).

    The one "try, and recognise an OOM" of the package: any other error propagates. The memory is
    freed outside the except block, where the failed frame's tensors are no longer referenced.
    """
    out_of_memory = False
    try:
        return run()
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        out_of_memory = True
    if out_of_memory:
        free_memory(device)
    return None
