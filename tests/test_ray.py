"""The Ray executor: the loop's gradients from actors in other processes, lost workers included.

One local Ray instance (2 CPUs, so 2 actors) serves the whole module.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn

import gradmap

ray = pytest.importorskip("ray")

# Ray starts its processes with subprocess (fork + exec at once), which JAX, if an earlier test
# module imported it, warns about; nothing runs between the fork and the exec.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

from gradmap._ray import RayExecutor  # noqa: E402
from gradmap._ray._cluster import ensure_connected  # noqa: E402

import support  # noqa: E402
from support import Killer, Setup, SlowBackward, loop, mark, ragged  # noqa: E402


@pytest.fixture(scope="module")
def ex() -> Iterator[RayExecutor]:
    started = not ray.is_initialized()
    ensure_connected(None, {"num_cpus": 2})
    # Functions and classes of this module travel by value (workers cannot import it).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(support)
    executor = RayExecutor(timeout=120)
    try:
        yield executor
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        cloudpickle.unregister_pickle_by_value(support)
        executor.shutdown()
        if started:
            ray.shutdown()


def _on_ray(ex: RayExecutor, **kwargs: Any) -> Any:
    return lambda f, xs: gradmap.tmap(f, xs, executor=ex, chunksize=2, **kwargs)


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _no_state_left(ex: RayExecutor) -> None:
    gc.collect()
    assert ex.stored_calls() == [0] * len(ex.actors())


def test_local_instance_listens_on_loopback(ex):
    assert len(ex.actors()) == 2
    if ray.util.get_node_ip_address() != "127.0.0.1":
        pytest.skip("Ray was connected before this module (not gradmap's local instance)")
    assert ex.worker_pids() and os.getpid() not in ex.worker_pids()


def test_gradients_match_loop_and_threads(ex):
    s = Setup()
    ref, ref_y = s.grads(loop)
    got, got_y = s.grads(_on_ray(ex))
    threads, _ = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor="threads", chunksize=2))
    for r, g in zip(ref + ref_y, got + got_y):
        torch.testing.assert_close(g, r)
    # One intra-op thread and the same chunks, summed in the same order: the threads' bits.
    _assert_bitwise(got, threads)
    _no_state_left(ex)


def test_deterministic_across_runs_and_workers(ex):
    s = Setup()
    first, _ = s.grads(_on_ray(ex))
    second, _ = s.grads(_on_ray(ex))
    one_actor, _ = s.grads(_on_ray(RayExecutor(workers=1)))
    _assert_bitwise(first, second)
    _assert_bitwise(first, one_actor)


def test_remat_matches_bitwise(ex):
    s = Setup()
    stored, _ = s.grads(_on_ray(ex))
    remat, _ = s.grads(_on_ray(ex, remat=True))
    _assert_bitwise(stored, remat)
    _no_state_left(ex)


def test_tensor_iterable_pytrees_and_objects(ex):
    x = torch.randn(6, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)

    def f(row: torch.Tensor, tag: str) -> dict[str, Any]:
        return {"y": (row * w).sum(), "pair": (row.norm(), tag), "n": row.numel()}

    tags = [f"t{i}" for i in range(6)]
    ref = [f(r, t) for r, t in zip(x, tags)]
    got = gradmap.tmap(f, x, tags, executor=ex, chunksize=4)
    assert [r["pair"][1] for r in got] == tags and [r["n"] for r in got] == [3] * 6
    loss = lambda out: sum(o["y"] + o["pair"][0] for o in out)  # noqa: E731
    for r, g in zip(torch.autograd.grad(loss(ref), [x, w]), torch.autograd.grad(loss(got), [x, w])):
        torch.testing.assert_close(g, r)


def test_random_f_gives_the_threads_results_and_generator_state(ex):
    xs = ragged(grad=False)
    w = torch.randn(4, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x * w, 0.5).sum() + torch.rand(()) * 0

    def run(executor: Any) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(1)
        ys = gradmap.tmap(f, xs, executor=executor, chunksize=3)
        (g,) = torch.autograd.grad(torch.stack(ys).sum(), [w])
        return [y.detach() for y in ys], g, torch.rand(())

    threads_y, threads_g, threads_next = run("threads")
    ray_y, ray_g, ray_next = run(ex)
    _assert_bitwise(ray_y, threads_y)
    assert torch.equal(ray_g, threads_g) and torch.equal(ray_next, threads_next)


def test_no_grad_and_default_dtype_reach_workers(ex):
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
    _no_state_left(ex)


def test_exception_in_f_names_the_element(ex):
    xs = ragged()

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 7:
            raise ValueError("bad bag")
        return x.sum()

    with pytest.raises(ValueError, match="bad bag") as info:
        gradmap.tmap(f, range(10), xs, executor=ex, chunksize=2)
    assert type(info.value) is ValueError
    assert any("element 7 (of 10)" in note for note in info.value.__notes__)
    _no_state_left(ex)


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fail: bool) -> torch.Tensor:
        ctx.fail = fail
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.fail:
            raise ArithmeticError("bad backward")
        return g, None


def test_exception_in_backward_names_the_element(ex):
    xs = ragged()
    ys = gradmap.tmap(
        lambda i, x: _FailingBackward.apply(x, i == 4).sum(),
        range(10),
        xs,
        executor=ex,
        chunksize=3,
    )
    with pytest.raises(ArithmeticError, match="bad backward") as info:
        torch.stack(ys).sum().backward()
    assert any("backward pass of element 4 (of 10)" in n for n in info.value.__notes__)
    del ys, info  # the traceback's frames hold the graph
    _no_state_left(ex)


def test_retain_graph_and_second_backward(ex):
    s = Setup()
    f = lambda x: (s.model(x) * s.w.sum()).sum()  # noqa: E731
    ys = gradmap.tmap(f, s.xs, executor=ex, chunksize=3)
    loss = torch.stack(ys).sum()
    (g1,) = torch.autograd.grad(loss, [s.w], retain_graph=True)
    (g2,) = torch.autograd.grad(loss, [s.w])
    (ref,) = torch.autograd.grad(torch.stack(loop(f, s.xs)).sum(), [s.w])
    assert torch.equal(g1, g2)
    torch.testing.assert_close(g1, ref)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    del ys, loss
    _no_state_left(ex)


def test_create_graph_is_refused(ex):
    w = torch.randn(3, requires_grad=True)
    ys = gradmap.tmap(lambda x: (x * w).pow(2).sum(), torch.ones(4, 3), executor=ex)
    with pytest.raises(NotImplementedError, match="create_graph"):
        torch.autograd.grad(torch.stack(ys).sum(), [w], create_graph=True)


def test_freed_graph_leaves_no_state(ex):
    s = Setup()
    ys = gradmap.tmap(lambda x: s.model(x).sum(), s.xs, executor=ex, chunksize=2)
    assert sum(ex.stored_calls()) >= 1  # the graphs wait on the actors for a backward
    del ys
    _no_state_left(ex)


def test_tensor_made_on_a_worker_and_reused_is_refused(ex):
    cache: dict[str, torch.Tensor] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        if "w" not in cache:  # made by the first element, used by the others: on the worker
            cache["w"] = torch.ones(3, requires_grad=True)
        return (x * cache["w"]).sum()

    with pytest.raises(RuntimeError, match="did not come from the caller"):
        gradmap.tmap(f, torch.ones(4, 3), executor=ex, chunksize=4)
    _no_state_left(ex)


def test_progress_counts_every_element_in_both_passes(ex):
    class Bar:
        total = 0

        def update(self, n: int) -> None:
            Bar.total += n

    w = torch.randn(3, requires_grad=True)
    ys = gradmap.tmap(lambda x: (x * w).sum(), torch.ones(7, 3), executor=ex, progress=Bar())
    torch.stack(ys).sum().backward()
    assert Bar.total == 14


# -- lost workers ------------------------------------------------------------------------------


def _lossy_grads(
    ex: RayExecutor, s: Setup, forward_marker: str | None, backward_marker: str | None
) -> list[torch.Tensor]:
    model, w = s.model, s.w
    b = s.a * 2

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        if i == 5 and forward_marker is not None and mark(forward_marker):
            time.sleep(60)
        h = SlowBackward.apply(x * w + b, backward_marker if i == 5 else None)
        return torch.sin(model(h)).sum() ** 2

    ys = gradmap.tmap(f, range(len(s.xs)), s.xs, executor=ex, chunksize=2)
    loss = sum((i + 1) * y for i, y in enumerate(ys))
    return list(torch.autograd.grad(loss, s.tensors()))


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_worker_killed_gives_the_same_gradients(ex, tmp_path, phase):
    s = Setup()
    expected = _lossy_grads(ex, s, None, None)
    pids = ex.worker_pids()
    marker = tmp_path / "pid"
    killer = Killer(marker, pids)
    markers = (str(marker), None) if phase == "forward" else (None, str(marker))
    got = _lossy_grads(ex, s, *markers)
    killer.join()
    assert len(killer.killed) == 1
    _assert_bitwise(got, expected)
    ref, _ = s.grads(loop)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    after = ex.worker_pids()  # the killed actor was restarted, in a new process
    assert killer.killed[0] not in after and len(after) == len(pids)
    _no_state_left(ex)


def test_worker_killed_between_forward_and_backward(ex):
    s = Setup()
    expected, _ = s.grads(_on_ray(ex))
    b = s.a * 2
    model, w = s.model, s.w
    f = lambda x: torch.sin(model(x * w + b)).sum() ** 2  # noqa: E731
    ys = gradmap.tmap(f, s.xs, executor=ex, chunksize=2)
    os.kill(ex.worker_pids()[0], signal.SIGKILL)
    loss = sum((i + 1) * y for i, y in enumerate(ys))
    got = list(torch.autograd.grad(loss, s.tensors()))
    _assert_bitwise(got, expected)
    del ys, loss
    _no_state_left(ex)


def test_executor_name_ray_gives_the_loops_results_and_gradients(ex):
    s = Setup()
    ref, ref_y = s.grads(loop)
    got, got_y = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor="ray", chunksize=2))
    for r, g in zip(ref + ref_y, got + got_y, strict=True):
        torch.testing.assert_close(g, r)


def test_missing_ray_says_how_to_install(monkeypatch):
    from gradmap._ray import _executor

    monkeypatch.setattr(_executor, "ray_installed", lambda: False)
    with pytest.raises(ImportError, match=r"pip install 'gradmap\[ray\]'"):
        RayExecutor()


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers"):
        RayExecutor(workers=0)
    with pytest.raises(ValueError, match="threads_per_worker"):
        RayExecutor(threads_per_worker=0)
    assert "RayExecutor(workers=3" in repr(RayExecutor(workers=3))


def test_unchanged_f_is_put_once_and_a_changed_one_is_seen(ex):
    model = nn.Linear(3, 1)
    xs = [torch.randn(3) for _ in range(4)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return model(x).sum() ** 2

    def check() -> None:
        model.zero_grad()
        torch.stack(gradmap.tmap(f, xs, executor=ex, chunksize=1)).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.stack([f(x) for x in xs]).sum().backward()
        for g, r in zip(got, [p.grad for p in model.parameters()]):
            torch.testing.assert_close(g, r)

    puts = ex.transport().puts
    check()
    before = len(puts._refs)
    check()
    assert len(puts._refs) == before  # the same payload: no second put
    with torch.no_grad():
        model.weight.mul_(-2.0)  # an optimizer's in-place step: a new payload
    check()
    assert len(puts._refs) == min(before + 1, 4)
