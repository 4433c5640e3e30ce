"""Facts of the kernel contract (docs/design.md §3) that the CPU kernels and their CUDA twins
share, so that both order, compare and sample entries the same way bit for bit.

* **Keys.** Every selection works on the key of |x|: the bits of x as a signed integer of x's
  width with the sign bit cleared, every NaN clamped to one key just above +inf. Positive IEEE
  floats order like their bit patterns, so ordering keys is ordering |x| under the contract's
  total order (NaN above +inf, -0.0 == 0.0). It also makes float16 first class on targets that
  have no float16 arithmetic.
* **Bit views.** Values are moved as the integers of the same width (``BITS``), so copies keep
  -0.0 and NaN payloads.
* **Canonical NaN.** A value computed by arithmetic (a sum, a quotient, a float16 rounding of a
  float32 sum) that is NaN is written as ``CANONICAL_NAN_BITS`` of its dtype: quiet, positive,
  zero payload. The NaN that hardware makes of NaN + x or inf - inf differs between x86, GPUs
  and compilers; written this way it is the same everywhere.
* **Sampling.** ``estimate_threshold`` draws sample j as SplitMix64(seed + (j + 1) * golden)
  mod n: a counter-based generator, so sample j depends only on (seed, j) and a GPU draws the
  same positions in parallel.

* **Where an array lives.** :func:`is_device_array` routes every call (public as
  :func:`spardl_kernels.devices.is_device_array`).

Host-side only (NumPy and Python numbers); the compiled code of each backend reads these
constants as globals.
"""

import functools
import importlib
import math

import numpy as np

# dtype name -> (signed integer view of the same width, mask clearing the sign bit, key of +inf).
# key(x) = (bits & mask), with every NaN clamped to inf_key + 1.
KEY_INFO = {
    "float16": (np.dtype(np.int16), 0x7FFF, 0x7C00),
    "float32": (np.dtype(np.int32), 0x7FFFFFFF, 0x7F800000),
    "float64": (np.dtype(np.int64), 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}

_NAMES = {np.dtype(name): name for name in KEY_INFO}


def dtype_name(dtype):
    """``np.dtype(dtype).name``, by a dict lookup for the value dtypes' own ``np.dtype``
    objects: NumPy computes ``.name`` in Python (about 3 µs), and the tables here are looked up
    on every kernel call."""
    name = _NAMES.get(dtype)
    return name if name is not None else np.dtype(dtype).name


# dtype name -> the signed integer dtype its values are moved as.
BITS = {name: view for name, (view, _, _) in KEY_INFO.items()}

# dtype name -> the bits of its canonical NaN (quiet, positive, zero payload), as BITS[name].
CANONICAL_NAN_BITS = {
    "float16": 0x7E00,
    "float32": 0x7FC00000,
    "float64": 0x7FF8000000000000,
}

# dtype name -> key width in bits (the sign bit excluded): 15, 31, 63.
KEY_BITS = {name: mask.bit_length() for name, (_, mask, _) in KEY_INFO.items()}

# SplitMix64 (Steele, Lea and Flood 2014): the increment and the two multipliers of its mix.
SPLITMIX64_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
SPLITMIX64_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
SPLITMIX64_MIX2 = np.uint64(0x94D049BB133111EB)


def canonical_nan_bits(dtype):
    """The canonical NaN of a value dtype as a scalar of its bit dtype (``BITS``)."""
    name = dtype_name(dtype)
    return BITS[name].type(CANONICAL_NAN_BITS[name])


def key_info(dtype):
    """(bits dtype, mask, inf_key, nan_key) of a value dtype (float16, float32 or float64)."""
    view_dtype, mask, inf_key = KEY_INFO[dtype_name(dtype)]
    return view_dtype, mask, inf_key, inf_key + 1


def key_to_value(key, dtype):
    """The non-negative value of ``dtype`` whose key is ``key`` (NaN for the NaN key)."""
    dtype = np.dtype(dtype)
    view_dtype, _, _, nan_key = key_info(dtype)
    if key == nan_key:
        return dtype.type(np.nan)
    return np.array(key, dtype=view_dtype).view(dtype)[()]


def threshold_key(t, dtype):
    """Smallest key K with value(K) >= t as float64, so that |x_i| >= t  <=>  key(x_i) >= K.

    NaN thresholds select only NaN entries (the total order puts NaN above every number).
    """
    dtype = np.dtype(dtype)
    view_dtype, _, inf_key, nan_key = key_info(dtype)
    if math.isnan(t):
        return nan_key
    if t <= 0.0:
        return 0
    with np.errstate(over="ignore"):
        c = np.array(t, dtype=np.float64).astype(dtype)  # t rounded to nearest in x's dtype
    K = int(c.view(view_dtype))
    if float(c) < t:
        # c rounded down; the next representable value up is the smallest one >= t
        # (c = largest finite -> K becomes inf_key).
        K += 1
    return min(K, inf_key)


@functools.cache
def numba_device_array_types():
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
        return isinstance(x, numba_device_array_types())
    return False
