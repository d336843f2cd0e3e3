"""gradmap's native boundary walk: built on first use, cached per torch build, or ``None``.

NOTE [the native walk]:
    A chunk's boundary is read off its graph by ``_native.cpp``'s ``walk``, in C++ on PyTorch's
    own autograd API, with no Python object per node (about 0.03 us a node where the Python
    walk took 1-1.5 us) and without the GIL. It knows exactly which nodes the chunk made: autograd
    gives every node the id of the thread that made it (``Node::thread_id``, never reused) and a
    number from that thread's counter (``sequence_nr``), and the chunk ran in one thread between
    two readings of that counter. So no tensor needs to be found in ``f``'s references or on the
    heap, and a node made by any other thread (the caller, another chunk, a thread of ``f``'s own)
    is never walked through.

    Every edge from the chunk's nodes to a non-leaf made elsewhere (a tensor computed before the
    call, an item cut from a tensor) is rewired through a *gate*: a node of the chunk's own that
    passes gradients on. The chunk's pullback asks for the gates' gradients: the engine captures
    them there and, since nothing it was asked for lies behind a gate, runs nothing past it, so
    the graph behind the boundary runs once, in the caller's backward, with the summed gradient,
    and the boundary tensors' own hooks (``register_hook``, ``retain_grad``) run there once, as
    in the loop. Edges to leaves are gated too where the chunk has such a non-leaf edge (else
    asking for a leaf at its accumulator would make the engine run the graph behind the gate to
    reach it, through the tensor made from it) or where the leaf has hooks; otherwise a leaf is
    asked for as it is (NOTE [leaves gated only past a non-leaf] in ``_native.cpp``). A gate
    touches no shared node (no hooks to add or remove on a node other maps may be pulling back
    through), and the join takes, for a non-leaf edge, a stand-in tensor on the edge itself (an
    expanded zero of the edge's shape: one element of memory).

    Built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) the first time a map
    needs it, in about 20 s, into ``$GRADMAP_CACHE`` (default ``~/.cache/gradmap``), keyed by the
    source, torch's version and the Python ABI; later processes import the built module directly.
    ``python -m gradmap build`` builds it ahead of time. Where it cannot be built, gradmap warns
    once and uses the Python walk of ``_graph`` (``GRADMAP_NATIVE=0`` chooses that walk).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["build", "cache_dir", "native"]

_SOURCE = Path(__file__).with_name("_native.cpp")
_lock = threading.Lock()
os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]  # NOTE [after a fork]
_module: ModuleType | None = None
_tried = False


def cache_dir() -> Path:
    """Where built modules are kept."""
    root = os.environ.get("GRADMAP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gradmap"
    )
    return Path(root) / "native"


def _name() -> str:
    key = hashlib.sha256()
    key.update(_SOURCE.read_bytes())
    for part in (torch.__version__, torch.__file__, sys.version, sysconfig.get_config_var("SOABI")):
        key.update(str(part).encode())
    return f"gradmap_native_{key.hexdigest()[:16]}"


def native() -> ModuleType | None:
    """The native module, built on first use; ``None`` where it cannot be (warned once)."""
    if _tried:
        return _module
    with _lock:
        if not _tried:
            _load()
    return _module


def build() -> Path:
    """Build (or find) the native module now, even where an earlier build failed; its path.
    Raises where it cannot be built."""
    global _module, _tried
    with _lock:
        _module, _tried = _import_or_build(retry=True), True
    return Path(str(_module.__file__))


def _load() -> None:
    global _module, _tried
    try:
        if os.environ.get("GRADMAP_NATIVE", "1") == "0":
            return
        _module = _import_or_build()
    except Exception as exc:  # no compiler, no ninja, a failed build: the Python walk
        warnings.warn(
            f"gradmap: its native graph walk could not be built ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}); using the "
            "Python walk, which is slower and cannot find every tensor f uses. Fix: install a "
            "C++ compiler (g++ or clang) and ninja (pip install ninja), then run "
            "`python -m gradmap build`.",
            RuntimeWarning,
            stacklevel=4,
        )
    finally:
        _tried = True


def _import_or_build(*, retry: bool = False) -> ModuleType:
    name = _name()
    where = cache_dir() / name
    built = where / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    plain = where / f"{name}.so"
    for path in (built, plain):
        if path.exists():
            return _import(name, path)
    failed = where / "FAILED"  # a build that failed is not tried again by every process
    if failed.exists() and not retry:
        raise RuntimeError(f"an earlier build failed ({failed}); `gradmap build` tries again")
    where.mkdir(parents=True, exist_ok=True)
    try:
        return _build(name, where)
    except Exception as exc:
        failed.write_text(f"{type(exc).__name__}: {exc}\n")
        raise


def _build(name: str, where: Path) -> ModuleType:
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # pip's ninja, in a virtual environment not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    print(
        f"gradmap: building its native graph walk into {where} (once; about 25 s)",
        file=sys.stderr,
        flush=True,
    )
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(_SOURCE)],
            build_directory=str(where),
            extra_cflags=["-O2"],
            verbose=False,
        )
    finally:
        os.environ["PATH"] = path  # the process's environment as it was
    return module  # type: ignore[no-any-return]


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
