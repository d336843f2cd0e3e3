"""The executors in other processes, both transports: worker processes (``executor="processes"``,
``gradmap.ProcessExecutor``, with and without the caller running chunks) and Ray actors
(``executor="ray"``, ``gradmap.RayExecutor`` on a real local Ray). The tests every remote executor
must pass: the loop's and the threads' gradients, determinism, pytrees, random numbers, errors
naming their element, graphs kept only while they wait, progress.

What is particular to one transport stays in its own module (``test_processes.py``,
``test_ray.py``); where the two differ in a detail here (an executor of one worker, what "no state
left" means), the `Remote` the fixture gives says it.

One executor per transport serves the whole module: a worker process takes about 1.5 s to start,
and Ray (2 CPUs, so 2 actors) is started once, skipped where it is not installed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.autograd.function import once_differentiable

import gradmap

import support
from support import Boom, Setup, close, loop, loop_sum, native_walk, noisy, notes, ragged, works

# Ray starts its processes with subprocess (fork + exec at once), which JAX, if an earlier test
# module imported it, warns about; nothing runs between the fork and the exec.
_RAY_FORK_WARNING = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


@dataclass
class Remote:
    """One transport: its executor and the details in which the transports differ."""

    name: str
    ex: Any
    #: A new executor of this transport with one worker.
    one_worker: Callable[[], Any]
    #: Asserts that the workers hold no map's state (graphs awaiting a backward).
    no_state_left: Callable[[], None]


def _process_remote(helps: bool) -> Iterator[Remote]:
    # Two worker processes either way; with the caller running chunks too (the default).
    executor = gradmap.ProcessExecutor(workers=3 if helps else 2, caller_helps=helps, timeout=120)

    def no_state_left() -> None:
        support.collect()
        assert sum(executor.stored_calls()) == 0

    try:
        with support.maps_reach_workers():
            yield Remote(
                "caller-helps" if helps else "processes-only",
                executor,
                lambda: gradmap.ProcessExecutor(workers=1, timeout=120),
                no_state_left,
            )
    finally:
        executor.shutdown()


def _ray_remote() -> Iterator[Remote]:
    ray = pytest.importorskip("ray")
    from gradmap._ray import RayExecutor
    from gradmap._ray._cluster import ensure_connected

    started = not ray.is_initialized()
    ensure_connected(None, {"num_cpus": 2})
    executor = RayExecutor(timeout=120)

    def no_state_left() -> None:
        support.collect()
        assert executor.stored_calls() == [0] * len(executor.actors())

    try:
        yield Remote(
            "ray",
            executor,
            lambda: RayExecutor(workers=1),
            no_state_left,
        )
    finally:
        executor.shutdown()
        if started:
            ray.shutdown()


@pytest.fixture(
    scope="module",
    params=[
        "caller-helps",
        "processes-only",
        pytest.param("ray", marks=_RAY_FORK_WARNING),
    ],
)
def remote(request: Any) -> Iterator[Remote]:
    with support.by_value(sys.modules[__name__]):
        if request.param == "ray":
            yield from _ray_remote()
        else:
            yield from _process_remote(request.param == "caller-helps")


@pytest.fixture(scope="module")
def ex(remote: Remote) -> Any:
    return remote.ex


def _on(ex: Any, **kwargs: Any) -> Any:
    return lambda f, *xs: gradmap.tmap(f, *xs, executor=ex, chunksize=2, **kwargs)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# -- results and gradients: the loop's and the threads' ---------------------------------------


def test_gradients_match_loop_and_threads(remote, ex):
    s = Setup()
    ref, ref_y = s.grads(loop)
    got, got_y = s.grads(_on(ex))
    threads, _ = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor="threads", chunksize=2))
    close(got_y, ref_y)
    close(got, ref)
    # One intra-op thread and the same chunks, summed in the same order: the threads' bits.
    _bitwise(got, threads)
    remote.no_state_left()


def test_deterministic_across_runs_workers_and_threads(remote, ex):
    s = Setup()
    first, _ = s.grads(_on(ex))
    second, _ = s.grads(_on(ex))
    one_worker, _ = s.grads(_on(remote.one_worker()))
    threads, _ = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor="threads", chunksize=2))
    _bitwise(first, second)
    _bitwise(first, one_worker)
    _bitwise(first, threads)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
@pytest.mark.parametrize("scale", [1.0, 2.5])  # a sum's cotangent one, and another
def test_groups_of_chunks_give_the_threads_bits(remote, ex, api, scale):
    # 64 chunks of one element: the sum adds groups of 4 chunks first (NOTE [chunk-order sum]),
    # and a worker adds up the gradients of a group it ran whole; the bits are the threads'.
    s = Setup()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1 + i % 3, 4, generator=g) for i in range(64)]
    wrt = [*s.model.parameters(), s.w, s.a]

    def grads(mapper: Any) -> list[torch.Tensor]:
        if api == "tsum":
            loss = mapper(gradmap.tsum) * scale
        else:
            loss = sum((i % 5 + 1) * y for i, y in enumerate(mapper(gradmap.tmap))) * scale
        return list(torch.autograd.grad(loss, wrt))

    def on(executor: Any) -> Any:
        return lambda run: run(s.f(), xs, executor=executor, chunksize=1)

    def plain(run: Any) -> Any:
        return loop_sum(s.f(), xs) if run is gradmap.tsum else loop(s.f(), xs)

    got, threads = grads(on(ex)), grads(on("threads"))
    _bitwise(got, threads)
    _bitwise(grads(on(remote.one_worker())), threads)
    close(got, grads(plain))
    remote.no_state_left()


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_remat_matches_loop_and_stored_bitwise(remote, ex, api):
    s = Setup()
    if api == "tmap":
        ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2, remat=True)
        loss = sum((i + 1) * y for i, y in enumerate(ys))
    else:
        loss = gradmap.tsum(s.f(), s.xs, executor=ex, chunksize=2, remat=True)
    ref_ys = loop(s.f(), s.xs)
    if api == "tmap":
        close([y.detach() for y in ys], [y.detach() for y in ref_ys])
    ref = sum((i + 1) * y for i, y in enumerate(ref_ys)) if api == "tmap" else sum(ref_ys)
    torch.testing.assert_close(loss, ref)
    close(torch.autograd.grad(loss, s.tensors()), torch.autograd.grad(ref, s.tensors()))
    if api == "tmap":
        # The recompute gives the stored graph's bits.
        s = Setup()
        stored, _ = s.grads(_on(ex))
        remat, _ = s.grads(_on(ex, remat=True))
        _bitwise(stored, remat)
    remote.no_state_left()


def test_pytree_results_and_objects(ex):
    # Tuples and dicts of tensors, ints and strings.
    xs = ragged(n=7)
    w = torch.randn(4, requires_grad=True)

    def f(x: torch.Tensor) -> tuple[Any, ...]:
        y = x * w
        return y.sum(), {"max": y.max(), "rows": x.shape[0], "mean": y.mean(0)}, "tag"

    ref = loop(f, xs)
    got = gradmap.tmap(f, xs, executor=ex, chunksize=3)
    assert [g[2] for g in got] == ["tag"] * 7
    assert [g[1]["rows"] for g in got] == [r[1]["rows"] for r in ref]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g[0], r[0])
        torch.testing.assert_close(g[1]["max"], r[1]["max"])
        torch.testing.assert_close(g[1]["mean"], r[1]["mean"])

    def loss(out: list[Any]) -> torch.Tensor:
        return sum(o[0] * 2 + o[1]["max"] + (o[1]["mean"] * torch.arange(4.0)).sum() for o in out)

    close(torch.autograd.grad(loss(got), [w, *xs]), torch.autograd.grad(loss(ref), [w, *xs]))

    # A tensor's rows and a list of strings as the iterables; a dict holding a tuple.
    x = torch.randn(6, 3, requires_grad=True)
    v = torch.randn(3, requires_grad=True)

    def g(row: torch.Tensor, tag: str) -> dict[str, Any]:
        return {"y": (row * v).sum(), "pair": (row.norm(), tag), "n": row.numel()}

    tags = [f"t{i}" for i in range(6)]
    ref2 = [g(r, t) for r, t in zip(x, tags)]
    got2 = gradmap.tmap(g, x, tags, executor=ex, chunksize=4)
    assert [r["pair"][1] for r in got2] == tags and [r["n"] for r in got2] == [3] * 6
    loss2 = lambda out: sum(o["y"] + o["pair"][0] for o in out)  # noqa: E731
    for r, h in zip(
        torch.autograd.grad(loss2(ref2), [x, v]), torch.autograd.grad(loss2(got2), [x, v])
    ):
        torch.testing.assert_close(h, r)


# -- random numbers ---------------------------------------------------------------------------


def _noisy_reference(w: torch.Tensor, xs: list[torch.Tensor], draws: list[torch.Tensor]) -> Any:
    # The loop with the same draws: f's formula with the noise and mask each element drew.
    return [((x * w + d[:, :-1]) ** 2 * d[:, -1:]).sum() for x, d in zip(xs, draws)]


@pytest.mark.parametrize("remat", [False, True], ids=["stored", "remat"])
def test_random_f_matches_threads_and_loop_with_same_draws(ex, remat):
    xs = ragged(grad=False)
    w = torch.randn(4, requires_grad=True)
    f = noisy(w)

    def run(executor: Any, **kwargs: Any) -> Any:
        torch.manual_seed(1)
        out = gradmap.tmap(f, xs, executor=executor, chunksize=3, **kwargs)
        ys = [o[0] for o in out]
        draws = [o[1].detach() for o in out]
        (g,) = torch.autograd.grad(sum((i + 1) * y for i, y in enumerate(ys)), [w])
        return [y.detach() for y in ys], draws, g, torch.rand(())

    t_ys, t_draws, t_g, t_next = run("threads")
    p_ys, p_draws, p_g, p_next = run(ex, remat=remat)
    close(p_draws, t_draws)
    close(p_ys, t_ys)
    torch.testing.assert_close(p_g, t_g)
    torch.testing.assert_close(p_next, t_next)  # the generator left where threads leave it
    # The gradient is the loop's with those draws.
    ref = _noisy_reference(w, xs, p_draws)
    close(p_ys, [r.detach() for r in ref])
    (r_g,) = torch.autograd.grad(sum((i + 1) * y for i, y in enumerate(ref)), [w])
    torch.testing.assert_close(p_g, r_g)
    # Draws differ from element to element (each has its own generator).
    assert not torch.equal(p_draws[0][0], p_draws[1][0])
    if remat:
        return
    # Dropout and a draw that is not used: the threads' bits, and the generator they leave.
    v = torch.randn(4, requires_grad=True)

    def h(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * v, 0.5).sum() + torch.rand(()) * 0

    def run2(executor: Any) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        ys = gradmap.tmap(h, xs, executor=executor, chunksize=3)
        (g,) = torch.autograd.grad(torch.stack(ys).sum(), [v])
        return [y.detach() for y in ys], g, torch.rand(())

    threads_y, threads_g, threads_next = run2("threads")
    got_y, got_g, got_next = run2(ex)
    _bitwise(got_y, threads_y)
    assert torch.equal(got_g, threads_g) and torch.equal(got_next, threads_next)


# -- grad mode and settings -------------------------------------------------------------------


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_no_grad_and_default_dtype_reach_workers(remote, ex, api):
    s = Setup()
    f = s.f()
    with torch.no_grad():
        ref = loop(f, s.xs)
        if api == "tmap":
            got = gradmap.tmap(f, s.xs, executor=ex, chunksize=2)
            assert not any(y.requires_grad for y in got)
            close(got, ref)
        else:
            got = gradmap.tsum(f, s.xs, executor=ex, chunksize=2)
            assert not got.requires_grad
            torch.testing.assert_close(got, torch.stack(ref).sum())
    if api == "tsum":
        return
    w = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        ys = gradmap.tmap(lambda x: (x * w).sum(), torch.ones(4, 3), executor=ex)
    assert not any(y.requires_grad for y in ys)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        dtypes = gradmap.tmap(lambda i: torch.zeros(1).dtype, range(3), executor=ex)
    finally:
        torch.set_default_dtype(previous)
    assert dtypes == [torch.float64] * 3
    remote.no_state_left()


def test_anomaly_mode_and_deterministic_algorithms_reach_workers(remote, ex):
    """Process-wide settings, as the loop runs ``f`` under them: anomaly mode (a NaN in the
    backward raises, naming the node) and ``use_deterministic_algorithms``; the workers' own
    settings are back afterwards."""

    def flags(i: int) -> tuple[bool, bool, bool]:
        return (
            torch.is_anomaly_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with torch.autograd.set_detect_anomaly(True):
            assert (
                gradmap.tmap(flags, range(6), executor=ex, chunksize=1) == [(True, True, True)] * 6
            )
            w = torch.ones(3, requires_grad=True)
            xs = [torch.zeros(3) for _ in range(6)]
            with pytest.raises(RuntimeError, match="returned nan values"):
                gradmap.tsum(
                    lambda x: (x * w).sqrt().sum() * 0.0, xs, executor=ex, chunksize=1
                ).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert gradmap.tmap(flags, range(6), executor=ex, chunksize=1) == [(False, False, False)] * 6
    remote.no_state_left()


def test_a_result_that_requires_grad_under_no_grad_is_refused(remote, ex):
    """An f that turns grad mode on inside a no_grad map returns, in the loop, results with their
    graph; from another process they would come back without it, their gradients lost: an error
    naming the element and the fix, not a result that silently does not require grad. (A sum
    under no_grad has no graph in the loop either: tsum gives it.)"""
    w = torch.randn(3, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        if x[0] < 2:
            return (x * 2).sum()
        with torch.enable_grad():
            return (x * w).sum()

    xs = torch.tensor([[0.0, 1, 1], [1, 1, 1], [2, 1, 1], [3, 1, 1]])
    with torch.no_grad():
        assert [y.requires_grad for y in loop(f, xs)] == [False, False, True, True]
        with pytest.raises(RuntimeError, match=r"element 2 \(of 4\) returned a") as info:
            gradmap.tmap(f, xs, executor=ex, chunksize=4)
        total = gradmap.tsum(f, xs, executor=ex, chunksize=2)
        assert not total.requires_grad and not sum(loop(f, xs)).requires_grad
        torch.testing.assert_close(total, sum(loop(f, xs)))
        assert "executor='threads'" in str(info.value)
        # A detached result is what the fix gives: the map runs.
        got = gradmap.tmap(lambda x: f(x).detach(), xs, executor=ex, chunksize=2)
    close(got, [f(x).detach() for x in xs])
    del info
    remote.no_state_left()


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_leaves_f_returns_come_back_as_they_are(remote, ex, grad):
    """A leaf requiring grad that f returns is handed out as in the loop (NOTE [leaves that come
    back from another process]): an item or a parameter of the caller's is the caller's very
    object, under grad mode and no_grad alike; a leaf f makes comes back as a fresh leaf,
    whose .grad the user's backward fills (with processes, it used to be a join alias whose
    .grad stayed None, or refused)."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(3, 2)
    xs = [torch.randn(3, requires_grad=True) for _ in range(5)]

    def f(x: torch.Tensor) -> Any:
        made = torch.full((2,), float(x.detach().sum()), requires_grad=True)
        return {"x": x, "w": lin.weight, "made": made, "twice": (made, made), "y": lin(x).sum()}

    def run(mapper: Callable[..., list[Any]]) -> tuple[list[Any], list[Any]]:
        with torch.set_grad_enabled(grad):
            ys = mapper(f, xs)
        if not grad:
            return ys, []
        loss = sum((y["x"] * 2).sum() + (y["made"] * 3).sum() + y["y"] for y in ys)
        loss.backward()
        grads = [lin.weight.grad.clone(), *(x.grad.clone() for x in xs)]
        grads += [y["made"].grad for y in ys]
        for t in (lin.weight, lin.bias, *xs):
            t.grad = None
        return ys, grads

    got, got_grads = run(_on(ex))
    ref, ref_grads = run(loop)
    for y, r, x in zip(got, ref, xs):
        assert y["x"] is x and y["w"] is lin.weight
        assert y["made"].is_leaf and y["made"].requires_grad and r["made"].is_leaf
        assert y["twice"][0] is y["twice"][1] is y["made"]
        torch.testing.assert_close(y["made"], r["made"])
        assert y["y"].requires_grad is r["y"].requires_grad is grad
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r)
    del got
    remote.no_state_left()


def test_a_tensor_of_the_callers_changed_in_place_and_returned_is_refused(remote, ex):
    """In the loop f's in-place change of a tensor of the user's changes the user's tensor; in
    another process it may stay in the worker's copy: an error naming the element."""
    xs = [torch.zeros(2, requires_grad=True) for _ in range(4)]

    def bump(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 2:
            with torch.no_grad():
                x.add_(1)
        return x

    with pytest.raises(RuntimeError, match=r"changed in place a tensor of yours .* element 2"):
        gradmap.tmap(bump, range(4), xs, executor=ex, chunksize=2)
    remote.no_state_left()


class _Holder:
    """An object of the user's holding a tensor (no pytree gradmap reads)."""

    def __init__(self, v: torch.Tensor) -> None:
        self.v = v


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_tensor_requiring_grad_inside_an_object_result_is_refused(remote, ex, grad):
    """The loop's gradient flows through a tensor an object of the user's holds; from another
    process the object comes back without the graph (the gradient was lost without a word):
    an error naming the element, the class and the fix. Without such a tensor the object comes
    back as it is."""
    xs = [torch.randn(2, requires_grad=True) for _ in range(4)]
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"element 0 .*_Holder"):
        _on(ex)(lambda x: _Holder(x * 2 if grad else x), xs)
    got = _on(ex)(lambda x: _Holder(x.detach() * 2), xs)
    assert all(torch.equal(h.v, x.detach() * 2) for h, x in zip(got, xs))
    remote.no_state_left()


class _Tagged(torch.Tensor):
    """A tensor subclass (its own torch function: what subclasses that carry metadata do)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


def test_results_of_a_tensor_subclass_keep_their_class(remote, ex):
    """A result of a tensor subclass (f uses a subclass tensor that requires grad) comes back of
    that class, as from the loop; it came back a plain tensor (the join detached it with
    subclasses' torch functions off)."""
    s = torch.randn(3).as_subclass(_Tagged).requires_grad_()
    xs = [torch.randn(3) for _ in range(4)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * s).sum()

    got = _on(ex)(f, xs)
    assert [type(y) for y in got] == [type(f(x)) for x in xs] == [_Tagged] * 4
    (g,) = torch.autograd.grad(sum(got), s)
    (want,) = torch.autograd.grad(sum(f(x) for x in xs), s)
    torch.testing.assert_close(g.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
    remote.no_state_left()


# -- errors -----------------------------------------------------------------------------------


class _LocalError(KeyError):
    """An exception class of this module: it travels by value, and must come back as itself."""


@pytest.mark.parametrize(
    "error", [ValueError, Boom, _LocalError], ids=["built-in", "imported", "by-value"]
)
def test_exception_in_forward_names_the_element(remote, ex, error):
    xs = ragged()

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 3:
            raise error("bad bag")
        return x.sum()

    for api in (gradmap.tmap, gradmap.tsum):
        with pytest.raises(error, match="bad bag") as info:
            api(f, range(10), xs, executor=ex, chunksize=2)
        assert type(info.value) is error
        assert any("element 3 (of 10)" in note for note in info.value.__notes__), notes(info.value)
        del info
    remote.no_state_left()
    works(ex)


class _FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises ``ArithmeticError(message)`` (``None``: does not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, message: str | None) -> torch.Tensor:
        ctx.message = message
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.message is not None:
            raise ArithmeticError(ctx.message)
        return g, None


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_exception_in_backward_names_the_element(remote, ex, api):
    xs = ragged()
    f = lambda i, x: _FailingBackward.apply(x, "bad backward" if i == 4 else None).sum()  # noqa: E731
    if api == "tmap":
        loss = torch.stack(gradmap.tmap(f, range(10), xs, executor=ex, chunksize=3)).sum()
        with pytest.raises(ArithmeticError, match="bad backward") as info:
            loss.backward()
        del loss
    else:
        # tsum pulls a chunk of losses back during the forward; one whose pullback fails is kept
        # and pulled back in the backward, which raises (NOTE [the error of the loop's element]).
        with pytest.raises(ArithmeticError, match="bad backward") as info:
            gradmap.tsum(f, range(10), xs, executor=ex, chunksize=3).backward()
    assert type(info.value) is ArithmeticError
    assert any("backward pass of element 4 (of 10)" in n for n in info.value.__notes__), notes(
        info.value
    )
    del info  # the traceback's frames hold the graph
    remote.no_state_left()
    works(ex)


def test_the_forward_raises_the_lowest_failing_elements_error_though_a_later_one_came_first(
    remote, ex
):
    """NOTE [the error of the loop's element]: the caller's own host takes chunks from the end of
    the queue, and element 15's ValueError came before the workers (busy with elements 0 and 1)
    had started element 7's chunk: it was raised, where the loop raises element 7's IndexError."""

    def f(i: int) -> torch.Tensor:
        if i < 2:
            time.sleep(0.3)
        if i == 7:
            raise IndexError("element 7 failed")
        if i == 15:
            raise ValueError("element 15 failed")
        return torch.ones((), requires_grad=True) * i

    for api in (gradmap.tmap, gradmap.tsum):
        with pytest.raises(IndexError, match="element 7 failed") as info:
            api(f, range(16), executor=ex, chunksize=1)
        assert "element 7 (of 16)" in notes(info.value)
        del info
    remote.no_state_left()
    works(ex)


@pytest.mark.parametrize("chunksize", [1, 3])
def test_backward_errors_of_several_elements_raise_the_loops(remote, ex, chunksize):
    """The loop's backward runs the elements made last first: its error is element 10's (NOTE
    [the error of the loop's element]); the map in other processes raised element 3's."""
    xs = ragged(12)

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        return (_FailingBackward.apply(x, f"backward of element {i}") if i in (3, 10) else x).sum()

    with pytest.raises(ArithmeticError) as loop_error:
        torch.stack(loop(f, range(12), xs)).sum().backward()
    ys = gradmap.tmap(f, range(12), xs, executor=ex, chunksize=chunksize)
    with pytest.raises(ArithmeticError) as info:
        torch.stack(ys).sum().backward()
    assert str(info.value) == str(loop_error.value) == "backward of element 10"
    assert "backward pass of element 10 (of 12)" in notes(info.value)
    del info, loop_error, ys
    remote.no_state_left()


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_a_backward_runs_no_element_that_reaches_none_of_its_inputs(remote, ex, api, remat):
    """``autograd.grad(out, inputs=[a])``: the loop's engine runs no element whose results reach
    none of ``a`` (as the threads' join prunes, ``MapGraph.wanted``); in other processes every
    chunk was pulled back, and the backward of such an element raised where the loop's runs
    none. Whole chunks (``chunksize=1``) and elements within a chunk (3)."""
    if not native_walk():
        pytest.skip("which inputs a backward needs comes from the native walk")
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(10)]

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        if i % 3 == 0:
            unreached = "the backward of an element that reaches no input asked for ran"
            return _FailingBackward.apply(x * b, unreached).sum()  # reaches b only
        return (x * a * b).sum() if i % 3 == 1 else (x * a).sum()

    (want,) = torch.autograd.grad(torch.stack(loop(f, range(10), xs)).sum(), [a])
    for chunksize in (1, 3):
        if api == "tmap":
            ys = gradmap.tmap(f, range(10), xs, executor=ex, chunksize=chunksize, remat=remat)
            total = torch.stack(ys).sum()
        else:
            total = gradmap.tsum(f, range(10), xs, executor=ex, chunksize=chunksize, remat=remat)
        (got,) = torch.autograd.grad(total, [a])
        close(got, want)
        del total
    remote.no_state_left()


# -- backward: twice, create_graph ------------------------------------------------------------


class _ClippedBackward(torch.autograd.Function):
    """User code in the backward: clips the cotangent it gets (not linear in it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.clamp(-0.01, 0.01)


def test_tmap_of_losses_pulled_back_early_gives_the_backwards_bits(remote, ex, monkeypatch):
    """NOTE [tmap's losses pulled back early]: after a backward that gave every result one
    cotangent, a map of the same f pulls its chunks of losses back in the forward; a backward
    with one cotangent again takes those gradients (the bits of the pullback it replaces, the
    threads' bits), one with other cotangents pulls the kept graphs back as ever, and the next
    map learns. User code in the backward sees the cotangent the loss brings."""
    from gradmap._placement import key_of, learn_uniform_cotangents
    from gradmap._remote import _map

    early: list[bool] = []
    one_cotangent = _map._Driver.one_cotangent

    def spy(self: Any, cotangents: Any) -> Any:
        early.append(any(c.ones is not None for c in self.chunks))
        return one_cotangent(self, cotangents)

    monkeypatch.setattr(_map._Driver, "one_cotangent", spy)
    s = Setup()
    xs = ragged(24)
    wrt = [*s.model.parameters(), s.w, *xs]
    model, w = s.model, s.w
    f = lambda x: torch.sin(model(x * w)).mean() ** 2  # noqa: E731
    weights = torch.arange(1.0, 25.0)
    losses = {
        "sum": lambda ys: sum(ys),
        "mean": lambda ys: torch.stack(ys).mean(),
        "weighted": lambda ys: (torch.stack(ys) * weights).sum(),
    }

    def grads(name: str, executor: Any) -> list[torch.Tensor]:
        ys = (
            loop(f, xs) if executor is None else gradmap.tmap(f, xs, executor=executor, chunksize=2)
        )
        return list(torch.autograd.grad(losses[name](ys), wrt))

    threads = {name: grads(name, "threads") for name in losses}
    learn_uniform_cotangents(key_of(f), False)  # (learnt per code: the other transports' run)
    first = grads("sum", ex)  # learns: one cotangent
    for name in ["sum", "sum", "mean", "weighted", "sum", "sum"]:
        got = grads(name, ex)
        _bitwise(got, threads[name]) if name != "mean" else close(got, threads[name])
        close(got, grads(name, None))
    _bitwise(first, threads["sum"])
    # the first map learnt; pulled back early until the weighted backward, learnt again after
    # (the native walk only: the Python walk does not see hooks on tensors f makes)
    assert early == ([False, True, True, True, True, False, True] if native_walk() else [False] * 7)
    remote.no_state_left()

    clipped = lambda x: _ClippedBackward.apply(torch.sin(model(x * w)).mean()) ** 2  # noqa: E731
    for _ in range(2):
        ys = gradmap.tmap(clipped, xs, executor=ex, chunksize=2)
        got = torch.autograd.grad(torch.stack(ys).mean() * 100, wrt)
        close(got, torch.autograd.grad(torch.stack(loop(clipped, xs)).mean() * 100, wrt))
    remote.no_state_left()


def test_a_loss_scale_reaches_a_half_precision_graph_as_in_the_loop(remote, ex):
    # NOTE [gradients of reduced precision] in ``_torch/_graph``: the worker does not pull such
    # a chunk back with cotangent one in the forward (tsum) or early (tmap).
    w = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
    xs = [torch.linspace(0.5, 2.0, 4) * k for k in range(1, 7)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return (w.half() * 1e-4 * x.half() * 1e-4).sum().float()

    (ref,) = torch.autograd.grad(sum(loop(f, xs)) * 1024, w)
    assert bool(ref.ne(0).all())
    (got,) = torch.autograd.grad(gradmap.tsum(f, xs, executor=ex, chunksize=2) * 1024, w)
    torch.testing.assert_close(got, ref)
    for _ in range(3):
        ys = gradmap.tmap(f, xs, executor=ex, chunksize=2)
        (got,) = torch.autograd.grad(sum(ys) * 1024, w)
        torch.testing.assert_close(got, ref)
    remote.no_state_left()


@pytest.mark.parametrize("remat", [False, True], ids=["stored", "remat"])
def test_backward_result_by_result_like_loop(remote, ex, remat):
    """``for y in ys: y.backward()``, as in the loop (NOTE [a backward of some results]): the
    workers keep each chunk until all its results are gone through, then forget it."""
    s = Setup()
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=3, remat=remat)
    ref = loop(s.f(), s.xs)
    order = [4, 0, 1, 2, 5]  # chunk {0, 1, 2} is all gone through, {3, 4, 5} is not
    for i in order:
        got = torch.autograd.grad(ys[i], [s.w, *s.model.parameters()])
        close(got, torch.autograd.grad(ref[i], [s.w, *s.model.parameters()]))
    if not remat:
        assert sum(ex.stored_calls()) >= 1  # chunk {3, 4, 5} waits on its worker
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
        ys[0].backward()
    del info
    rest = [3, 6, 7, 8, 9]  # the other results: every chunk is gone through
    got = torch.autograd.grad(sum(ys[i] * i for i in rest), [s.w])
    close(got, torch.autograd.grad(sum(ref[i] * i for i in rest), [s.w]))
    remote.no_state_left()
    del ys


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_retain_graph_then_second_backward(remote, ex, api):
    s = Setup()
    f = s.f()
    if api == "tmap":
        loss = torch.stack(gradmap.tmap(f, s.xs, executor=ex, chunksize=3)).sum()
    else:
        loss = gradmap.tsum(f, s.xs, executor=ex, chunksize=3)
    ref = torch.autograd.grad(torch.stack(loop(s.f(), s.xs)).sum(), s.tensors())
    g1 = torch.autograd.grad(loss, s.tensors(), retain_graph=True)
    g2 = torch.autograd.grad(loss, s.tensors())
    close(g1, ref)
    close(g2, ref)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    del loss
    if api == "tmap":
        # The second backward gives the first's bits.
        s = Setup()
        h = lambda x: (s.model(x) * s.w.sum()).sum()  # noqa: E731
        ys = gradmap.tmap(h, s.xs, executor=ex, chunksize=3)
        loss = torch.stack(ys).sum()
        (h1,) = torch.autograd.grad(loss, [s.w], retain_graph=True)
        (h2,) = torch.autograd.grad(loss, [s.w])
        (r,) = torch.autograd.grad(torch.stack(loop(h, s.xs)).sum(), [s.w])
        assert torch.equal(h1, h2)
        torch.testing.assert_close(h1, r)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        del ys, loss
    remote.no_state_left()


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_create_graph_is_refused_naming_threads(ex, api):
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64)
    f = lambda x: (x * w).pow(2).sum()  # noqa: E731
    if api == "tmap":
        loss = torch.stack(gradmap.tmap(f, xs, executor=ex, chunksize=2)).sum()
    else:
        loss = gradmap.tsum(f, xs, executor=ex, chunksize=2)
    with pytest.raises(NotImplementedError, match="create_graph") as info:
        torch.autograd.grad(loss, [w], create_graph=True)
    assert "executor='threads'" in str(info.value)
    del loss, info
    works(ex)


def test_batched_backward_is_refused_naming_threads(ex):
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64)
    y = torch.stack(gradmap.tmap(lambda x: (x * w).pow(2).sum(), xs, executor=ex, chunksize=2))
    with pytest.raises(NotImplementedError, match="batched backward") as info:
        torch.autograd.grad(y, w, torch.eye(4, dtype=torch.float64), is_grads_batched=True)
    assert "executor='threads'" in str(info.value)
    del y, info
    works(ex)


def test_state_only_the_callers_thread_has_runs_the_loop_here(ex):
    """Under saved-tensor hooks the map runs as the plain loop in the caller (NOTE [state only
    the caller's thread has]): the hooks see every saved tensor, as in the loop."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64)
    packed: list[list[int]] = [[], []]
    for k, mapper in enumerate((loop, _on(ex))):
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, k=k: packed[k].append(t.numel()) or t, lambda t: t
        ):
            if k:
                with pytest.warns(RuntimeWarning, match="runs as the plain loop"):
                    ys = mapper(lambda x: (x * w).sin().sum(), xs)
            else:
                ys = mapper(lambda x: (x * w).sin().sum(), xs)
        torch.stack(ys).sum().backward()
    assert packed[0] == packed[1] != []
    assert sum(ex.stored_calls()) == 0
    works(ex)


def test_an_f_that_runs_backward_itself_is_refused(remote, ex):
    """``loss.backward()`` inside f accumulates, in the loop, into the user's parameters; in a
    worker, into its own leaves for them: an error naming the fix, not gradients lost."""
    s = Setup()
    model = s.model

    def step(x: torch.Tensor) -> float:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss.item()

    with pytest.raises(RuntimeError, match=r"f wrote \.grad of a tensor of yours") as info:
        gradmap.tmap(step, s.xs, executor=ex, chunksize=3)
    assert "gradmap.tsum(f, xs).backward()" in str(info.value)
    assert all(p.grad is None for p in model.parameters())
    del info
    remote.no_state_left()
    # The same model, used as the map expects: the loop's gradients.
    total = gradmap.tsum(lambda x: model(x).pow(2).mean(), s.xs, executor=ex, chunksize=3)
    close(
        torch.autograd.grad(total, list(model.parameters())),
        torch.autograd.grad(sum(model(x).pow(2).mean() for x in s.xs), list(model.parameters())),
    )
    works(ex)


# -- state on the workers ---------------------------------------------------------------------


def test_freed_graph_leaves_no_state(remote, ex):
    s = Setup()
    ys = gradmap.tmap(lambda x: s.model(x).sum(), s.xs, executor=ex, chunksize=2)
    assert sum(ex.stored_calls()) >= 1  # the graphs wait on the workers for a backward
    del ys
    remote.no_state_left()


def test_tensor_made_on_a_worker_and_reused_is_refused(remote, ex):
    cache: dict[str, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        if "w" not in cache:  # made by the first element, used by the others: on the worker
            cache["w"] = torch.ones(3, requires_grad=True)
        return (x * cache["w"]).sum()

    with pytest.raises(RuntimeError, match="did not come from the caller"):
        gradmap.tmap(f, torch.ones(4, 3), executor=ex, chunksize=4)
    remote.no_state_left()


def test_a_leaf_f_makes_for_itself_and_lets_go_gives_the_loops_gradients(remote, ex):
    """Forces: ``f`` differentiates inside through a leaf it makes from a copy of its item; the
    loop's backward reaches that leaf too, whose ``.grad`` nobody holds (NOTE [leaves f makes
    for itself on a worker])."""
    s = Setup()
    params = list(s.model.parameters())

    def energy_and_forces(x: torch.Tensor) -> torch.Tensor:
        pos = x.clone().requires_grad_()
        energy = s.model(torch.tanh(pos)).sum()
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        return energy**2 + forces.pow(2).sum()

    want = torch.autograd.grad(loop_sum(energy_and_forces, s.xs), params)
    total = gradmap.tsum(energy_and_forces, s.xs, executor=ex, chunksize=2)
    close(torch.autograd.grad(total, params), want)
    ys = gradmap.tmap(energy_and_forces, s.xs, executor=ex, chunksize=2)
    close(torch.autograd.grad(torch.stack(ys).sum(), params), want)
    del ys
    remote.no_state_left()


def test_an_item_made_to_require_grad_in_place_is_refused(remote, ex):
    """``x.requires_grad_()`` on an item: the loop fills that item's ``.grad`` in the caller's
    process, which a worker's copy of it cannot."""
    s = Setup()
    xs = [x.detach().clone() for x in s.xs]

    def forces_in_place(x: torch.Tensor) -> torch.Tensor:
        x.requires_grad_()
        energy = s.model(x).sum()
        return torch.autograd.grad(energy, x, create_graph=True)[0].pow(2).sum()

    with pytest.raises(gradmap.ForeignTensorError, match=r"x\.requires_grad_\(\)"):
        gradmap.tsum(forces_in_place, xs, executor=ex, chunksize=2)
    remote.no_state_left()


class _SortedOnce(torch.autograd.Function):
    """A custom Function whose backward is ``once_differentiable`` (which names a C++ autograd
    node class, ``DelayedError``) and whose second output is marked non-differentiable."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        values, order = x.sort()
        ctx.mark_non_differentiable(order)
        ctx.save_for_backward(order)
        return values, order

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor, _: Any) -> torch.Tensor:  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return torch.zeros_like(g).scatter_(0, order, g)


def test_a_custom_function_with_a_once_differentiable_backward(remote, ex):
    s = Setup()
    rows = [x.detach()[0] for x in s.xs]

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, order = _SortedOnce.apply(x * s.w)
        return values[-1] + 0.5 * values[0], order.argmax()

    want = torch.autograd.grad(sum(y[0] for y in loop(f, rows)), s.w)
    ys = gradmap.tmap(f, rows, executor=ex, chunksize=2)
    assert all(not y[1].requires_grad for y in ys)
    close(torch.autograd.grad(sum(y[0] for y in ys), s.w), want)
    del ys
    remote.no_state_left()


def test_progress_counts_every_element_in_both_passes(ex):
    class Bar:
        total = 0

        def update(self, n: int) -> None:
            Bar.total += n

    w = torch.randn(3, requires_grad=True)
    ys = gradmap.tmap(lambda x: (x * w).sum(), torch.ones(7, 3), executor=ex, progress=Bar())
    torch.stack(ys).sum().backward()
    assert Bar.total == 14


def test_parameters_are_told_apart_as_isinstance_does() -> None:
    """The pickler's quick parameter check agrees with ``isinstance(t, nn.Parameter)``, tensor
    subclasses made parameters (the ``_is_param`` flag) included."""
    from torch.nn.parameter import UninitializedParameter

    from gradmap._remote._pickling import _is_parameter

    class Sub(torch.Tensor):
        pass

    class MyParameter(torch.nn.Parameter):
        pass

    flagged = torch.nn.Parameter(torch.ones(2).as_subclass(Sub))
    plain_flagged = torch.ones(2)
    plain_flagged._is_param = True  # type: ignore[attr-defined]
    cases = [
        torch.ones(2, requires_grad=True),
        torch.ones(2).as_subclass(Sub),
        torch.nn.Parameter(torch.ones(2)),
        MyParameter(torch.ones(2)),
        UninitializedParameter(),
        flagged,
        plain_flagged,
    ]
    assert [_is_parameter(t) for t in cases] == [isinstance(t, torch.nn.Parameter) for t in cases]
    assert [_is_parameter(t) for t in cases] == [False, False, True, True, True, True, True]


def test_the_remembered_submodule_lookup_answers_as_cloudpickles_own() -> None:
    """NOTE [the submodules a function names]: the same modules for functions naming
    submodules through their package, a new answer once a module is imported, and cloudpickle's
    own lookup back after gradmap pickled."""
    import types

    import cloudpickle

    from gradmap._remote import _pickling

    own = cloudpickle.cloudpickle._find_imported_submodules
    own_state = cloudpickle.cloudpickle._function_getstate
    names = {}
    code = compile("torch.nn.functional.relu(x) + torch.linalg.norm(x) + os.path.sep", "f", "exec")
    gone = types.ModuleType("gradmap_test_submodule_parent")
    gone.__package__ = gone.__name__
    for dependencies in ([torch, sys], [torch], [sys, 3, "torch"], []):
        want = own(code, dependencies)
        assert _pickling._remembered_submodules(code, iter(dependencies)) == want
        assert _pickling._remembered_submodules(code, dependencies) == want  # remembered
        names[len(dependencies)] = {m.__name__ for m in want}
    assert {"torch.nn", "torch.nn.functional", "torch.linalg"} <= names[2]
    sys.modules[gone.__name__] = gone
    child = types.ModuleType(gone.__name__ + ".nn")
    try:
        sys.modules[child.__name__] = child  # imported since: a new answer
        later = compile("p.nn.x", "g", "exec")
        assert _pickling._remembered_submodules(later, [gone]) == [child]
        del sys.modules[child.__name__]
        assert _pickling._remembered_submodules(later, [gone]) == []
    finally:
        sys.modules.pop(child.__name__, None)
        del sys.modules[gone.__name__]
    table = _pickling.TensorTable()
    _pickling.dumps(lambda x: torch.nn.functional.relu(x), table, share=True)
    assert cloudpickle.cloudpickle._find_imported_submodules is own
    assert cloudpickle.cloudpickle._function_getstate is own_state


@pytest.mark.parametrize(
    "make",
    [
        lambda i: torch.tensor(float(i)),  # 0-d losses
        lambda i: torch.arange(6, dtype=torch.float64).reshape(2, 3) * i,  # rows
        lambda i: torch.tensor([i, -i]),  # int64
        lambda i: torch.tensor([i % 2 == 0]),  # bool
        lambda i: torch.full((2,), float(i), dtype=torch.bfloat16),  # no numpy dtype
        lambda i: torch.ones(i % 3 + 1),  # shapes that differ
        lambda i: torch.tensor(float(i)) if i != 4 else None,  # a missing cotangent
        lambda i: torch.ones(2, 2).t() * i,  # not contiguous
    ],
)
def test_lists_of_small_tensors_travel_as_one_and_come_back_apart(make) -> None:
    """NOTE [many small tensors travel as one]: the same values, each tensor its own (a write
    into one leaves the others' versions as they were), pairs with pids too."""
    from gradmap._remote._pickling import dumps_results, loads_results

    tensors = [make(i) for i in range(12)]
    pairs = [(100 + i, t) for i, t in enumerate(tensors) if t is not None]
    got, got_pairs, few = loads_results(dumps_results((tensors, pairs, tensors[:3])))
    for back, sent in ((got, tensors), (few, tensors[:3])):
        assert len(back) == len(sent)
        for a, b in zip(back, sent):
            if b is None:
                assert a is None
            else:
                assert type(a) is torch.Tensor and a.dtype == b.dtype
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [pid for pid, _ in got_pairs] == [pid for pid, _ in pairs]
    for (_, a), (_, b) in zip(got_pairs, pairs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    versions = [t._version for t in got if t is not None]
    got[0].copy_(got[0].clone())
    assert [t._version for t in got if t is not None][1:] == versions[1:]
    assert got[0]._version != versions[0]
    assert got[0].data_ptr() != got[1].data_ptr()


@pytest.mark.parametrize("ex", ["processes"])
def test_a_result_written_in_place_leaves_the_others_backward_as_in_the_loop(ex) -> None:
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(16, 3)

    def f(x):
        return (x * w).sum()

    def run(ys):
        z = ys[1] * ys[1]  # saves ys[1]
        ys[0].mul_(2)  # in the loop this leaves ys[1] alone
        return torch.autograd.grad(z + ys[0], w)[0]

    torch.testing.assert_close(run(gradmap.tmap(f, xs, executor=ex)), run(loop(f, xs)))


@pytest.mark.parametrize("ex", ["processes"])
def test_items_that_require_grad_travel_as_one_with_the_loops_gradients(ex) -> None:
    """NOTE [many small tensors travel as one]: a chunk of leaves (one twice), or of the rows of
    a tensor made before the call, loads as the call's leaves: the loop's results and
    gradients, a leaf passed twice counted twice."""
    torch.manual_seed(8)
    w = torch.randn(3, requires_grad=True)
    a = torch.randn(16, 3, requires_grad=True)
    leaves = [torch.randn(3, requires_grad=True) for _ in range(15)]
    for items in ([*leaves, leaves[2]], a * 2):

        def f(x):
            return (x * w).tanh().sum()

        got = gradmap.tmap(f, items, executor=ex, chunksize=16)
        ref = loop(f, items)
        close(got, ref)
        wrt = [w, *leaves] if isinstance(items, list) else [w, a]
        loss = lambda ys: sum((i + 1) * y for i, y in enumerate(ys))  # noqa: E731
        have = torch.autograd.grad(loss(got), wrt, retain_graph=True)
        close(have, torch.autograd.grad(loss(ref), wrt))


def test_process_wide_settings_are_set_only_where_they_change(monkeypatch):
    # torch.use_deterministic_algorithms imports torch._inductor.config on its first call (about
    # a second), which a fresh worker's first map paid inside its timeout: a map of a trivial f
    # with ProcessExecutor(timeout=1.0) timed out every time. It is called only to change.
    from gradmap._remote import _host

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *a, **k: calls.append(a))
    now = (torch.are_deterministic_algorithms_enabled(), False)
    with _host._set_process_wide(torch.get_default_dtype(), (False, False), now):
        pass
    assert calls == []
    with _host._set_process_wide(torch.get_default_dtype(), (False, False), (not now[0], False)):
        pass
    assert calls == [(not now[0],), (now[0],)]
