"""Helpers shared by the test modules: hard deadlines, thread accounting, executors, errors,
killing workers.

Test modules import it as ``from support import ...``: ``tests/`` has no ``__init__.py``, so
pytest (import mode ``prepend``) puts this folder on ``sys.path`` before it imports them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import functools
import gc
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradmap
from gradmap import _executors

# -- references and data -------------------------------------------------------------------------


def loop(f: Callable[..., Any], *iterables: Any) -> list[Any]:
    """The reference: the plain loop that ``tmap`` replaces."""
    return [f(*args) for args in zip(*iterables, strict=False)]


#: A cache in a module workers import by reference, for ``test_processes``: what f keeps in it
#: on a worker is the worker's own (the error says where the worker holds it).
CACHE: dict[str, Any] = {}


def ragged(n: int = 10, d: int = 4, seed: int = 0, grad: bool = True) -> list[torch.Tensor]:
    """``n`` items of 1-6 rows of ``d`` features."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(int(k), d, generator=g).requires_grad_(grad)
        for k in torch.randint(1, 7, (n,), generator=g)
    ]


class Setup:
    """An MLP, a closure tensor, a non-leaf tensor made before the call, and ragged items."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.w = torch.randn(4, requires_grad=True)
        self.a = torch.randn(4, requires_grad=True)
        self.xs = ragged()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), self.w, self.a, *self.xs]

    def f(self) -> Any:
        b = self.a * 2  # non-leaf: its own graph runs once, on the driver
        model, w = self.model, self.w

        def f(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(model(x * w + b)).sum() ** 2

        return f

    def grads(self, mapper: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ys = mapper(self.f(), self.xs)
        loss = sum((i + 1) * y for i, y in enumerate(ys))
        return list(torch.autograd.grad(loss, self.tensors())), [y.detach() for y in ys]


def noisy(w: torch.Tensor) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """An ``f`` that draws noise and a mask: its loss, and the draws (noise, then mask)."""

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(x.shape)
        keep = (torch.rand(x.shape[0], 1) > 0.3).to(x.dtype)
        return ((x * w + noise) ** 2 * keep).sum(), torch.cat([noise, keep], 1)

    return f


def close(got: Any, ref: Any) -> None:
    """``got`` and ``ref`` hold close tensors, one by one (``None`` where ``ref`` has ``None``)."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r)


def loop_sum(f: Callable[..., Any], *iterables: Any) -> Any:
    """The reference of ``tsum``: the loop's results summed in order (pytrees leaf by leaf)."""
    results = loop(f, *iterables)
    total = results[0]
    for y in results[1:]:
        total = torch.utils._pytree.tree_map(torch.add, total, y)
    return total


def works(executor: Any) -> None:
    """A map after an error, a kill or a restart: the loop's results and gradients."""
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(5, 3)
    f = lambda x: torch.tanh(x * w).sum()  # noqa: E731
    ys = gradmap.tmap(f, xs, executor=executor, chunksize=1)
    ref = loop(f, xs)
    close(ys, ref)
    close(
        torch.autograd.grad(torch.stack(ys).sum(), [w]),
        torch.autograd.grad(torch.stack(ref).sum(), [w]),
    )


# -- errors ---------------------------------------------------------------------------------------


class Boom(ValueError):
    """The exception the tests' ``f`` raises on purpose."""


class Diverged(RuntimeError):
    """An error whose ``__init__`` takes other arguments than it passes on (a solver's): it
    does not load from its default pickle."""

    def __init__(self, step: int, residual: float) -> None:
        super().__init__(f"diverged at step {step} (residual {residual})")
        self.step = step


def notes(exc: BaseException) -> str:
    """All notes of ``exc``, one a line."""
    return "\n".join(getattr(exc, "__notes__", []))


def gradmap_notes(exc: BaseException) -> list[str]:
    """The notes gradmap added to ``exc``."""
    return [n for n in getattr(exc, "__notes__", []) if n.startswith("gradmap")]


# -- hard deadlines -------------------------------------------------------------------------------


def stacks() -> str:
    """Every thread's stack, for the message of a test that hung."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        frame = frames.get(t.ident or -1)
        if frame is None:
            continue
        out.append(f"--- {t.name}\n" + "".join(traceback.format_stack(frame)[-6:]))
    return "\n".join(out)


class Hang(AssertionError):
    """Raised in the main thread by the watchdog of a test that ran past its deadline."""


def deadline(seconds: float, *, main_thread: bool = False) -> Callable[[Any], Any]:
    """Fail the test if it runs longer than ``seconds``.

    By default the body runs in a daemon thread that the test joins with a timeout: a hang leaves
    that thread behind but the run goes on. With ``main_thread=True`` (for tests that need signals,
    which Python delivers to the main thread only) the body runs in the main thread and a watchdog
    thread sends it SIGUSR1, whose handler raises [`Hang`][], once a second until it returns;
    ``faulthandler`` kills the process as a last resort.
    """

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if main_thread:
                return _in_main_thread(fn, seconds, args, kwargs)
            return _in_daemon_thread(fn, seconds, args, kwargs)

        return wrapper

    return decorate


def collect() -> None:
    """A full garbage collection that ran, in this thread: for checks of what is left alive.

    ``gc.collect()`` returns at once, collecting nothing, while another thread's collection is
    under way, and with the GIL a pool thread's collection lets the GIL go while it frees
    tensors. A count taken then saw the last maps' graphs alive, gone a moment later (test_leaks,
    after failing backwards on threads: 45-125 tensors, in about one run of four; CI failed on
    it once). So this collects again until a collection of all generations ran here."""
    me = threading.get_ident()
    ran: list[bool] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2 and threading.get_ident() == me:
            ran.append(True)

    gc.callbacks.append(seen)
    try:
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            gc.collect()
            if not ran:
                time.sleep(0.001)
    finally:
        gc.callbacks.remove(seen)
    assert ran, "no garbage collection could run in 10 s: another thread's never ended"


def settle_before_threads_exit() -> None:
    """On a free-threaded interpreter, a collection before threads that ran maps exit.

    There an object is counted by the thread that made it; one that other threads released
    waits in that thread's queue, and a thread that exits frees what its queue holds as its
    state is torn down, where PyTorch 2.12's tensor finalizer (``THPVariable_clear``) waits to
    attach a thread state that never comes: the suite hung (gdb: ``tstate_wait_attach`` under
    ``PyThreadState_Clear``, a test's closure over a tensor) or crashed there, once in a few
    runs. A collection hands every thread's queue to the collecting thread, which frees the
    objects while it runs Python."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        gc.collect()


def _in_daemon_thread(fn: Any, seconds: float, args: Any, kwargs: Any) -> Any:
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["exc"] = exc
        finally:
            settle_before_threads_exit()

    t = threading.Thread(target=body, name=f"deadline-{fn.__name__}", daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"hang: {fn.__name__} still running after {seconds} s\n{stacks()}")
    if "exc" in box:
        raise box["exc"]
    return box.get("result")


def _in_main_thread(fn: Any, seconds: float, args: Any, kwargs: Any) -> Any:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    done = threading.Event()
    report: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        raise Hang(f"hang: {fn.__name__} still running after {seconds} s\n{report[0]}")

    def watchdog() -> None:
        if done.wait(seconds):
            return
        report.append(stacks())
        while not done.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)  # type: ignore[arg-type]
            done.wait(1.0)

    previous = signal.signal(signal.SIGUSR1, on_signal)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    dog = threading.Thread(target=watchdog, name="deadline-watchdog", daemon=True)
    dog.start()
    try:
        return fn(*args, **kwargs)
    finally:
        done.set()
        dog.join()
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGUSR1, previous)


# -- threads --------------------------------------------------------------------------------------


def spawn_all(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    """Make ``pool`` start every thread it may ever have (threads start lazily, on demand)."""
    n = pool._max_workers  # type: ignore[attr-defined]
    barrier = threading.Barrier(n + 1)
    futures = [pool.submit(barrier.wait, 10) for _ in range(n)]
    barrier.wait(10)
    for fut in futures:
        fut.result(10)


def settle_threads(
    *user_pools: concurrent.futures.ThreadPoolExecutor, workers: int | None = None
) -> int:
    """Start all threads of gradmap's shared pool (grown to ``workers``, by default the cores
    available) and of the given user pools, wait for replaced pools' threads to exit, and return
    the thread count: the baseline."""
    n = _executors.available_cores() if workers is None else workers
    gradmap.tmap(lambda i: torch.ones(1) * i, range(2 * n), workers=workers)
    pools = _executors.shared_pools(n)  # the pools behind executor="threads"
    for p in (*pools, *user_pools):
        spawn_all(p)
    stop = time.monotonic() + 10
    while time.monotonic() < stop:
        if len(gradmap_threads()) <= sum(p._max_workers for p in pools):  # type: ignore[attr-defined]
            break
        time.sleep(0.01)
    return threading.active_count()


def gradmap_threads() -> list[threading.Thread]:
    """The threads of gradmap's pools alive now."""
    return [t for t in threading.enumerate() if t.name.startswith("gradmap")]


def assert_threads_back(baseline: int, timeout: float = 5.0) -> None:
    """The thread count returns to ``baseline`` (helpers may still be leaving their context)."""
    stop = time.monotonic() + timeout
    while threading.active_count() != baseline and time.monotonic() < stop:
        time.sleep(0.005)
    names = sorted(t.name for t in threading.enumerate())
    assert threading.active_count() == baseline, f"threads: {names}, baseline {baseline}"


# -- executors ------------------------------------------------------------------------------------

EXECUTORS = ["serial", "threads", "threads-4", "user-pool"]

# Chunk sizes that give small maps several chunks (the ``tmap_kwargs`` fixture's).
SMALL_CHUNKS = {"serial": 2, "threads": 2, "threads-4": 1, "user-pool": 2}


@contextlib.contextmanager
def executor_kwargs(name: str) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    """``tmap`` keyword arguments for one executor, and the user pools it made (to settle).

    ``name`` is ``"serial"``, ``"threads"`` (the shared pool, default workers), ``"threads-N"``
    (the shared pool with ``workers=N``) or ``"user-pool"`` (a ``ThreadPoolExecutor`` of 2
    threads, shut down on exit).
    """
    if name == "serial":
        yield {"executor": "serial"}, []
    elif name == "threads":
        yield {"executor": "threads"}, []
    elif name.startswith("threads-"):
        yield {"executor": None, "workers": int(name.removeprefix("threads-"))}, []
    elif name == "user-pool":
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            yield {"executor": pool}, [pool]
            settle_before_threads_exit()
    else:
        raise ValueError(f"unknown executor name {name!r}")


# -- killing workers (processes, Ray) -------------------------------------------------------------
# Used inside f on the workers: the suites that do register this module with
# cloudpickle.register_pickle_by_value (a Ray worker cannot import it).


#: The test process: ``mark`` never marks it (a map's chunks may run there too, and the killer
#: kills worker processes only). Pickled by value into the workers, where it is not their pid.
_TEST_PROCESS = os.getpid()


def mark(marker: str) -> bool:
    """Create ``marker`` with this process's pid, once: True for the one worker process that did
    (never the test process)."""
    if os.getpid() == _TEST_PROCESS:
        return False
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def our_child(pid: int) -> bool:
    """Whether ``pid`` is a child of this process (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()


class Killer:
    """Kills the process whose pid appears in ``marker`` (a worker waiting to be killed): one of
    ``pids`` or a child of this process, never anything else (``strangers`` lists those)."""

    def __init__(self, marker: Path, pids: list[int]) -> None:
        self.marker, self.pids = marker, pids
        self.killed: list[int] = []
        self.strangers: list[int] = []
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        stop = time.monotonic() + 120
        while time.monotonic() < stop:
            try:
                text = self.marker.read_text().strip()
            except FileNotFoundError:
                text = ""
            if text:
                pid = int(text)
                if pid not in self.pids and not our_child(pid):
                    self.strangers.append(pid)
                    return
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
                return
            time.sleep(0.005)

    def join(self) -> None:
        self._thread.join(timeout=5)


class SlowBackward(torch.autograd.Function):
    """Identity; the backward of the marked element waits to be killed (once)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marker: str | None) -> torch.Tensor:
        ctx.marker = marker
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.marker is not None and mark(ctx.marker):
            time.sleep(60)
        return g, None


# -- the boundary walk ----------------------------------------------------------------------------


def native_walk() -> bool:
    """Whether maps read chunk boundaries with the native walk (else the Python walk, which
    cannot find every tensor made before the call and says so)."""
    from gradmap._torch._native import native

    return native() is not None


@contextlib.contextmanager
def python_walk() -> Iterator[None]:
    """Maps in this block read chunk boundaries with the Python walk (as where the native walk
    cannot be built). Skips the test on a free-threaded interpreter, where the Python walk is
    not run (node wrappers are made lazily, unlocked: it crashed there)."""
    from gradmap._torch import _native

    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        pytest.skip("the Python walk needs the GIL (node wrappers are made lazily, unlocked)")

    native = _native.native()
    _native._module = None
    try:
        yield
    finally:
        _native._module = native


@contextlib.contextmanager
def by_value(module: Any) -> Iterator[None]:
    """Within it, ``module`` and this support module travel to worker processes by value (the
    workers cannot import test modules)."""
    import cloudpickle

    for m in (module, sys.modules[__name__]):
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in (module, sys.modules[__name__]):
            cloudpickle.unregister_pickle_by_value(m)


@contextlib.contextmanager
def maps_reach_workers() -> Iterator[None]:
    """Within it, maps of a few elements go to the worker processes: the rule that runs a map
    measured to be tiny in the caller alone (``_process/_local.TINY``) is off."""
    from gradmap._process import _local

    tiny, _local.TINY = _local.TINY, 0.0
    try:
        yield
    finally:
        _local.TINY = tiny
