"""A state (``state_dict()`` output, nested dicts and lists) as plain data for an exact
comparison: arrays and tensors become (kind, dtype, shape, bytes), so that a float32 and a
float64 of equal values, or a tensor and an array, never compare equal."""

from __future__ import annotations

import numpy as np


def plain_state(obj):
    """``obj`` with every dict sorted by key, every tuple a list, every NumPy array
    ``("array", dtype, shape, bytes)`` and every torch tensor ``("tensor", dtype, shape,
    bytes)`` (its values on the CPU; a bfloat16 one's as float32, which holds each exactly:
    NumPy has no bfloat16); anything else as it is."""
    if isinstance(obj, dict):
        return {k: plain_state(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [plain_state(v) for v in obj]
    if hasattr(obj, "detach"):  # a torch tensor (torch is not imported for NumPy-only tests)
        host = obj.detach().cpu()
        values = host.float() if str(host.dtype) == "torch.bfloat16" else host
        return ("tensor", str(host.dtype), tuple(host.shape), values.numpy().tobytes())
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.shape, obj.tobytes())
    return obj
