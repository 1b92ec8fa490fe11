"""Why the GPU tests cannot run here, if they cannot (they skip saying so)."""

from __future__ import annotations

import pytest


def gpu_missing_reason() -> str | None:
    """None when cupy sees a CUDA GPU, else what is missing."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'kvstack[gpu]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "no CUDA GPU"
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"no usable CUDA driver: {exc}"
    return None


def torch_cuda_missing_reason() -> str | None:
    """None when memsvc (cupy) and the model worker (torch) can both use the GPU."""
    reason = gpu_missing_reason()
    if reason is not None:
        return reason
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA (the model worker needs a CUDA build)"
    return None


needs_gpu = pytest.mark.skipif(
    gpu_missing_reason() is not None, reason=f"GPU test: {gpu_missing_reason()}"
)
needs_gpu_torch = pytest.mark.skipif(
    torch_cuda_missing_reason() is not None, reason=f"GPU test: {torch_cuda_missing_reason()}"
)
