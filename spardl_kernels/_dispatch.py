"""Route each public kernel call to the CPU kernels or to their CUDA twins.

A call goes to ``spardl_kernels.cuda`` when any array argument lives on the GPU, otherwise to
``spardl_kernels.cpu``. ``numba.cuda`` is imported only when an argument looks like a GPU
array, so CPU-only use never pays for (or depends on) the CUDA toolchain.
"""

import functools
import importlib

KERNEL_NAMES = (
    "topk_abs",
    "kth_largest_abs",
    "select_above",
    "count_above",
    "estimate_threshold",
    "merge_add",
    "coalesce",
    "uniform_bounds",
    "balanced_bounds",
    "block_offsets",
    "scatter_add",
    "gather",
)


def _numba_device_array_types():
    """Numba's device array classes, real and simulator (``FakeCUDAArray``), where importable."""
    types = []
    for module, name in (
        ("numba.cuda.cudadrv.devicearray", "DeviceNDArray"),
        ("numba.cuda.simulator.cudadrv.devicearray", "FakeCUDAArray"),
    ):
        try:
            types.append(getattr(importlib.import_module(module), name))
        except Exception:  # noqa: BLE001 - any failure means "not this kind of array"
            continue
    return tuple(types)


def is_device_array(x):
    """True if ``x`` is a GPU array: it exposes ``__cuda_array_interface__`` or is a Numba device
    array (including the CUDA simulator's ``FakeCUDAArray``).

    Parameters
    ----------
    x : object

    Returns
    -------
    bool

    Notes
    -----
    NumPy arrays, Python lists and scalars return quickly without importing ``numba.cuda``; it is
    imported only when ``type(x).__module__`` mentions numba and cuda. ``hasattr`` is used
    because CPU torch tensors raise AttributeError for ``__cuda_array_interface__``.
    """
    if hasattr(x, "__cuda_array_interface__"):
        return True
    module = getattr(type(x), "__module__", "") or ""
    if "numba" in module and "cuda" in module:
        return isinstance(x, _numba_device_array_types())
    return False


def _cuda_module():
    try:
        return importlib.import_module("spardl_kernels.cuda")
    except Exception as exc:  # noqa: BLE001 - reported with its cause below
        raise RuntimeError(
            "spardl_kernels: a GPU array was passed but CUDA support is unavailable "
            f"(importing spardl_kernels.cuda failed: {type(exc).__name__}: {exc}). "
            "Install numba-cuda and a CUDA driver, or set NUMBA_ENABLE_CUDASIM=1 to use the "
            "simulator."
        ) from exc


def backend_for(*arrays):
    """The kernel module for these arguments: ``spardl_kernels.cuda`` if any is a GPU array."""
    for a in arrays:
        if is_device_array(a):
            return _cuda_module()
    return importlib.import_module("spardl_kernels.cpu")


def public(name, array_params):
    """The public function ``name``: the CPU kernel's signature and docstring, dispatching on the
    positional/keyword arguments named in ``array_params``."""
    from . import cpu

    impl = getattr(cpu, name)

    @functools.wraps(impl)
    def kernel(*args, **kwargs):
        arrays = [args[i] for i in range(min(len(array_params), len(args)))]
        arrays += [kwargs[p] for p in array_params[len(args) :] if p in kwargs]
        return getattr(backend_for(*arrays), name)(*args, **kwargs)

    kernel.__module__ = "spardl_kernels"
    return kernel
