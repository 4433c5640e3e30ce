"""``spardl info``: versions, the MPI library, CPU threads and GPUs."""

from __future__ import annotations

import os
import platform

from ..mpiexec import mpiexec_path

__all__ = ["add_info", "info_lines"]


# -- info --------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def add_info(sub) -> None:
    """``spardl info``: versions, MPI library, CPU threads and GPUs."""
    p = sub.add_parser("info", help="versions, MPI library, CPUs and GPUs")
    p.set_defaults(func=_cmd_info)


def info_lines() -> list[tuple[str, str]]:
    """(label, value) pairs printed by ``spardl info``."""
    import numba
    import numpy

    import spardl

    rows = [
        ("spardl", spardl.__version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("numpy", numpy.__version__),
        ("numba", numba.__version__),
        ("numba-cuda", _version("numba-cuda") or "not installed"),
    ]
    try:
        import mpi4py
        from mpi4py import MPI

        lib = MPI.Get_library_version().strip().splitlines()[0]
        rows += [
            ("mpi4py", mpi4py.__version__),
            ("MPI library", lib),
            (
                "MPI vendor",
                "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
            ),
            ("MPI standard", "{}.{}".format(*MPI.Get_version())),
        ]
    except ImportError as e:
        rows.append(("mpi4py", f"not available ({e})"))
    rows.append(("mpiexec", _which_mpiexec()))
    try:
        import torch

        rows.append(("torch", torch.__version__))
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        rows.append(("GPUs (torch.cuda)", ", ".join(gpus) if gpus else "none"))
    except ImportError:
        rows.append(("torch", "not installed"))
    rows.append(("GPUs (numba)", _numba_gpus()))
    rows.append(
        (
            "CPU threads",
            f"{os.cpu_count()} (usable: {len(os.sched_getaffinity(0))})"
            if hasattr(os, "sched_getaffinity")
            else str(os.cpu_count()),
        )
    )
    from ..comm import cuda_aware, cuda_aware_reason

    rows.append(("CUDA-aware MPI", f"{'yes' if cuda_aware() else 'no'} ({cuda_aware_reason()})"))
    return rows


def _which_mpiexec() -> str:
    try:
        return mpiexec_path()
    except FileNotFoundError:
        return "not found"


def _numba_gpus() -> str:
    try:
        from numba import cuda

        if not cuda.is_available():
            return "none"
        return ", ".join(
            f"{d.name.decode() if isinstance(d.name, bytes) else d.name}" for d in cuda.gpus
        )
    except Exception as e:  # noqa: BLE001 - a broken driver must not break `info`
        return f"none ({type(e).__name__})"


def _cmd_info(args) -> int:
    rows = info_lines()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
