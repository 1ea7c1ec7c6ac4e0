"""microbatch.memory.oom: out-of-memory failures recognised by type and by the allocating library's status."""

from __future__ import annotations

import pytest
import torch

from microbatch.memory.oom import is_out_of_memory

# Messages as torch re-raises them (c10 CUDA_CHECK / TORCH_CUDABLAS_CHECK / cuDNN / NCCL checks).
OOM_ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE"),
    RuntimeError("cuFFT error: CUFFT_ALLOC_FAILED"),
    RuntimeError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`"),
    RuntimeError("CUDA error: cudaErrorMemoryAllocation"),
    RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO "
        "for details), NCCL version 2.21.5\nncclSystemError: System call (e.g. socket, malloc) or "
        "external library call failed or device error.\nLast error:\nFailed to CUDA calloc 6291456 bytes"
    ),
    RuntimeError(
        "NCCL error: ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
        "Cuda failure 'out of memory'"
    ),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] err == 0. DefaultCPUAllocator: can't allocate memory"),
]
OTHER_ERRORS = [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"),
    RuntimeError(
        "NCCL error: ncclSystemError: System call (e.g. socket) failed.\nLast error:\nsocket timeout"
    ),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
    ValueError("out of memory"),  # not an error torch raises for memory
    KeyError("CUBLAS_STATUS_ALLOC_FAILED"),
]


@pytest.mark.parametrize("error", OOM_ERRORS, ids=lambda e: type(e).__name__ + ":" + str(e)[:40])
def test_recognised(error: BaseException) -> None:
    assert is_out_of_memory(error)


@pytest.mark.parametrize("error", OTHER_ERRORS, ids=lambda e: type(e).__name__ + ":" + str(e)[:40])
def test_not_recognised(error: BaseException) -> None:
    assert not is_out_of_memory(error)


def test_distributed_backend_error_is_recognised() -> None:
    dist_backend_error = getattr(torch.distributed, "DistBackendError", None)
    if dist_backend_error is None:
        pytest.skip("torch.distributed.DistBackendError is not in this build")
    assert is_out_of_memory(
        dist_backend_error("NCCL error: ncclInternalError ... Failed to CUDA calloc 4096 bytes")
    )
