"""GPU arrays and the CUDA backend, for the kernels' dispatch and for code built on the kernels.

:func:`is_device_array` is the one test of "does this array live on the GPU" (the kernels route
on it; ``spardl`` keeps its buffers on the side it names). :func:`cuda_backend` imports
:mod:`spardl_kernels.cuda` on first use and says in one error why it cannot, so CPU-only use never
imports ``numba.cuda``.
"""

from ._contract import is_device_array

__all__ = ["is_device_array", "cuda_backend"]


def cuda_backend():
    """The CUDA twins, :mod:`spardl_kernels.cuda` (imported on the first call).

    Raises
    ------
    RuntimeError
        When CUDA support is unavailable (no numba-cuda, no driver or GPU and the simulator not
        enabled), naming the cause.
    """
    try:
        import spardl_kernels.cuda as cuda
    except Exception as exc:  # noqa: BLE001 - reported with its cause below
        raise RuntimeError(
            "spardl_kernels: a GPU array was passed but CUDA support is unavailable "
            f"(importing spardl_kernels.cuda failed: {type(exc).__name__}: {exc}). "
            "Install numba-cuda and a CUDA driver, or set NUMBA_ENABLE_CUDASIM=1 to use the "
            "simulator."
        ) from exc
    return cuda
