"""The import graph of ``spardl`` and ``spardl_kernels``: no cycle and no private name taken
across packages.

Imports are read with :mod:`ast` from the source, at every depth (module level, inside functions,
under ``if TYPE_CHECKING``), so a deferred import counts like any other. A cycle makes the
modules' meaning depend on which one is imported first; a private name (a dotted part starting
with ``_``) belongs to its package, whose authors may change it without notice.

An edge runs from a module to each module of ours it names: ``import a.b.c`` and
``from a.b import c`` name ``a.b.c`` when that is a module, else ``a.b`` (c is then an
attribute). A package is not an edge target by way of its children: ``import a.b`` loads
``a/__init__`` too, but that ``__init__`` imports its own children, not the importer, so the
cycles this test is after still show.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spardl", "spardl_kernels")


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the two packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(name: str, level: int, importer: str) -> str:
    """The absolute dotted name of a (possibly relative) import in module ``importer``."""
    if level == 0:
        return name
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _imports(module: str) -> list[tuple[str, int]]:
    """(dotted name imported, line) for every import statement of ``module``, at any depth;
    ``from a import b`` gives ``a.b``."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, module)
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _target(name: str) -> str | None:
    """The module of ours that ``name`` refers to (itself, or the module holding the
    attribute), or None for a module of another distribution."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for name, _ in _imports(module):
            target = _target(name) if _ours(name) else None
            if target is not None and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_every_module_and_deferred_imports():
    assert "spardl.cli" in MODULES and "spardl_kernels.cuda.select" in MODULES
    # a function-level import counts (spardl.result imports the kernels inside a method)
    assert any(name == "spardl_kernels" for name, _ in _imports("spardl.result"))
    assert _resolve("_validate", 2, "spardl_kernels.cpu.select") == "spardl_kernels._validate"
    assert _resolve("", 1, "spardl_kernels.cpu") == "spardl_kernels.cpu"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _owner_of_private("spardl_kernels._dispatch.public") == "spardl_kernels"
    assert _owner_of_private("spardl_kernels.cpu._common.KEY_INFO") == "spardl_kernels.cpu"
    assert _owner_of_private("spardl.algorithms.base._work_dtype") == "spardl.algorithms"
    assert _owner_of_private("spardl_kernels.cuda.arrays") is None


# Known exceptions, each to be removed with its cause; a test fails when one no longer occurs, so
# the lists only shrink.
KNOWN_CYCLES: list[list[str]] = []
KNOWN_PRIVATE: list[str] = []


def test_import_graph_has_no_cycle():
    cycles = _cycles(_graph())
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, "\n".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"no longer a cycle, remove from KNOWN_CYCLES: {gone}"


def _owner_of_private(name: str) -> str | None:
    """The package a private name belongs to, or None when ``name`` has no private part.

    The first dotted part that starts with ``_`` (``__init__``-style names excepted) is private to
    the package holding it: ``spardl_kernels._dispatch`` to ``spardl_kernels``,
    ``spardl_kernels.cpu._common.KEY_INFO`` to ``spardl_kernels.cpu``, ``spardl.algorithms.base.
    _work_dtype`` (a module's private attribute) to ``spardl.algorithms``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            return owner if _is_package(owner) else owner.rpartition(".")[0]
    return None


def test_no_private_name_is_imported_from_outside_its_package():
    """Across ``spardl`` / ``spardl_kernels``, and between the kernel backends ``cpu`` / ``cuda``:
    what is shared is public, or lives in the parent package both may use."""
    bad = []
    for module in MODULES:
        for name, line in _imports(module):
            owner = _owner_of_private(name) if _ours(name) else None
            if owner is not None and not (module == owner or module.startswith(owner + ".")):
                bad.append((f"{MODULES[module].relative_to(ROOT)}: {name}", line))
    new = [f"{where} (line {line})" for where, line in bad if where not in KNOWN_PRIVATE]
    assert not new, "\n".join(new)
    gone = sorted(set(KNOWN_PRIVATE) - {where for where, _ in bad})
    assert not gone, f"no longer imported, remove from KNOWN_PRIVATE: {gone}"


def test_no_module_of_ours_is_imported_by_a_string():
    """``importlib.import_module("spardl...")`` hides an edge from this test and from readers."""
    bad = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute | ast.Name)
                and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and _ours(node.args[0].value)
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.args[0].value}")
    assert not bad, "\n".join(bad)


# The modules that import mpi4py besides spardl.comm, why, and the only names of mpi4py each may
# use: none of them communicates; each names the world communicator at start-up, reports
# versions, or reads the thread level MPI was initialised with.
MPI_AT_START_UP = {
    "spardl.cli.common": (
        "the world communicator every CLI command runs its collectives on",
        {"COMM_WORLD"},
    ),
    "spardl.cli.info": (
        "the versions of mpi4py and of the MPI library (spardl info)",
        {"__version__", "Get_library_version", "get_vendor", "Get_version"},
    ),
    "spardl.torch": (
        "MPI.COMM_WORLD, the default communicator of init_process_group_from_mpi, and the thread "
        "level (a communication thread needs THREAD_SERIALIZED)",
        {"COMM_WORLD", "Query_thread", "THREAD_SINGLE", "THREAD_FUNNELED", "THREAD_SERIALIZED"},
    ),
}


def _mpi4py_uses(module: str) -> tuple[list[int], set[str]]:
    """(lines importing mpi4py, attribute names taken from the names bound to mpi4py)."""
    tree = ast.parse(MODULES[module].read_text())
    lines, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mpi4py":
                    lines.append(node.lineno)
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpi4py":
            lines.append(node.lineno)
            bound.update(alias.asname or alias.name for alias in node.names)
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in bound
    }
    return lines, used


def test_only_spardl_comm_communicates_through_mpi4py():
    """Every message goes through :class:`spardl.comm.Comm` (its accounting, clock and GPU
    policy): no other module reaches the communicator a Comm wraps (``.mpi``, ``._mpi``,
    ``._clocked``, also by ``getattr``) or imports mpi4py, except to name the world communicator
    at start-up or report versions (MPI_AT_START_UP)."""
    hidden = {"mpi", "_mpi", "_clocked"}
    bad = []
    for module, path in MODULES.items():
        if module == "spardl.comm":
            continue
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in hidden:
                bad.append(f"{where}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in hidden
            ):
                bad.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        lines, used = _mpi4py_uses(module)
        if lines and module not in MPI_AT_START_UP:
            bad.append(f"{where}:{lines[0]}: imports mpi4py")
        elif lines and not used <= MPI_AT_START_UP[module][1]:
            bad.append(f"{where}: uses mpi4py's {sorted(used - MPI_AT_START_UP[module][1])}")
    assert not bad, "\n".join(bad)
    missing = [m for m in MPI_AT_START_UP if not _mpi4py_uses(m)[0]]
    assert not missing, f"no longer imports mpi4py, remove from MPI_AT_START_UP: {missing}"


def test_the_mpi4py_check_sees_uses_and_imports():
    assert _mpi4py_uses("spardl.comm")[0] and "Status" in _mpi4py_uses("spardl.comm")[1]
    lines, used = _mpi4py_uses("spardl.cli.info")
    assert lines and "Get_library_version" in used and "__version__" in used


# -- what importing costs -------------------------------------------------------------------------
# Each in a fresh interpreter: this one has imported MPI already. mpi4py.MPI initialises MPI when
# imported, which a process that only parses options, prints help or launches mpiexec must not.


def _fresh(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


_MPI_LOADED = "print('mpi4py.MPI' in sys.modules)"


def test_import_spardl_does_not_import_mpi():
    assert _fresh("import spardl, sys; " + _MPI_LOADED) == "False"


def test_the_cluster_command_line_does_not_import_mpi():
    """``spardl cluster`` (its help, and ``run`` up to the point where it needs root) and the
    checks of its options: the launcher runs outside mpiexec and starts mpiexec itself."""
    code = (
        "import sys\n"
        "from spardl.cli import main\n"
        "for argv in (['cluster', '--help'], ['cluster', 'run', '--help'],\n"
        "             ['cluster', 'run', '-N', '2', '--bandwidth', '-1mbit', '--', 'true']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "status = main(['cluster', 'run', '-N', '2', '--latency', '1ms', '--', 'nosuchprog_q'])\n"
        "print(status, 'mpi4py.MPI' in sys.modules)\n"
    )
    assert _fresh(code).splitlines()[-1] == "2 False"


def test_spardl_help_does_not_import_mpi():
    code = (
        "import contextlib, sys\n"
        "from spardl.cli import main\n"
        "with contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n" + _MPI_LOADED
    )
    assert _fresh(code).splitlines()[-1] == "False"


def test_the_public_names_load_on_first_use():
    code = (
        "import sys\n"
        "import spardl\n"
        "assert set(spardl.__all__) <= set(dir(spardl)), dir(spardl)\n"
        "from spardl import make, Comm, SparseResult, NonFiniteError, Allreducer\n"
        "from spardl import abort_on_exception\n"
        "assert spardl.ALGORITHMS is spardl.ALGORITHMS and type(spardl.ALGORITHMS) is dict\n"
        "assert spardl.ALGORITHMS['spardl'] is spardl.SparDL\n"
        "assert issubclass(spardl.ALGORITHMS['dense'], Allreducer)\n"
        "assert spardl.comm.Comm is Comm and spardl.cost_model.__name__ == 'spardl.cost_model'\n"
        "assert not hasattr(spardl, 'no_such_name')\n"
        "print(sorted(spardl.ALGORITHMS), 'mpi4py.MPI' in sys.modules)\n"
    )
    algorithms = ["dense", "gaussiank", "gtopk", "oktopk", "spardl", "topka", "topkdsa"]
    assert _fresh(code) == f"{algorithms} True"


def test_a_submodule_imported_first_loads_without_a_cycle():
    """``import spardl.algorithms.oktopk`` before any name of the package: its modules ask the
    package for their siblings (``from .. import _arrays``) while it is being imported."""
    code = (
        "import spardl.algorithms.oktopk as m, spardl\n"
        "print(spardl.ALGORITHMS['oktopk'] is m.OkTopk)\n"
    )
    assert _fresh(code) == "True"


def test_the_algorithm_names_known_without_mpi_are_the_keys_of_algorithms():
    import spardl

    assert spardl.ALGORITHM_NAMES == tuple(spardl.ALGORITHMS)


def test_a_name_set_before_the_first_use_leaves_the_others_loadable():
    """``spardl.ALGORITHMS`` assigned before any deferred name was read once made every other
    deferred name a KeyError (the load took ALGORITHMS for its own mark of being done)."""
    code = (
        "import spardl\n"
        "mine = {}\n"
        "spardl.ALGORITHMS = mine\n"
        "assert spardl.Comm.__name__ == 'Comm' and hasattr(spardl, 'SparseResult')\n"
        "assert spardl.ALGORITHMS is mine\n"
        "print('ok')\n"
    )
    assert _fresh(code).splitlines()[-1] == "ok"
