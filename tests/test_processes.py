"""The process executor (``executor="processes"``, ``gradmap.ProcessExecutor``): the plain loop's
results and gradients from worker processes; shared memory, random numbers, errors, dead workers.

What every remote executor must do (Ray's too) is tested in ``test_remote.py``; here, what is the
process executor's own.

One executor of 2 workers serves the whole module (a worker takes about 1.5 s to start).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradmap
from gradmap._process import _local

import support
from support import (
    Killer,
    Setup,
    SlowBackward,
    close,
    deadline,
    loop,
    loop_sum,
    mark,
    noisy,
    notes,
    ragged,
    works,
)

#: Every worker pid a test saw (killed ones included): none may outlive ``shutdown``.
_SEEN_PIDS: set[int] = set()


@pytest.fixture(scope="module", params=[True, False], ids=["caller-helps", "processes-only"])
def ex(request: Any) -> Iterator[Any]:
    # Two worker processes either way; with the caller running chunks too (the default).
    helps = request.param
    executor = gradmap.ProcessExecutor(workers=3 if helps else 2, caller_helps=helps, timeout=120)
    # ``test_a_tiny_map_runs_in_the_caller_alone`` turns the tiny-map rule back on.
    try:
        with support.by_value(sys.modules[__name__]), support.maps_reach_workers():
            yield executor
    finally:
        executor.shutdown()


def _pids(ex: Any) -> list[int]:
    pids = ex.worker_pids()
    _SEEN_PIDS.update(pids)
    return pids


def _on(ex: Any, **kwargs: Any) -> Any:
    return lambda f, *xs: gradmap.tmap(f, *xs, executor=ex, chunksize=2, **kwargs)


# -- results and gradients: the loop's --------------------------------------------------------


def test_runs_on_the_workers(ex):
    pids = _pids(ex)
    assert len(pids) == 2 and os.getpid() not in pids
    seen = gradmap.tmap(lambda i: os.getpid(), range(8), executor=ex, chunksize=1)
    assert set(seen) <= {*pids, os.getpid()}
    assert (os.getpid() in seen) <= ex.caller_helps


def test_the_caller_runs_chunks_as_a_worker_would(ex):
    # The caller's chunks: maps inside f run serially, one intra-op thread, and the caller's
    # generator and thread count are as they were after the map.
    if not ex.caller_helps:
        pytest.skip("the caller does not run chunks")
    threads = torch.get_num_threads()

    def f(i: int) -> tuple[int, int, int]:
        inner = gradmap.tmap(lambda j: os.getpid(), range(3), executor="processes")
        return os.getpid(), torch.get_num_threads(), len(set(inner))

    seen = gradmap.tmap(f, range(16), executor=ex, chunksize=1)
    assert os.getpid() in {pid for pid, _, _ in seen}
    assert all(n == 1 and distinct == 1 for _, n, distinct in seen)
    assert torch.get_num_threads() == threads
    # The caller's chunks seed the generator per element; it is left as a serial map leaves it
    # (f drew nothing: one draw on, NOTE [the generator after a map]) and as the threads would
    # leave it (f drew).
    torch.manual_seed(3)
    state = torch.get_rng_state()
    w = torch.ones(3, requires_grad=True)
    gradmap.tmap(lambda x: (x * w).sum(), torch.ones(16, 3), executor="serial")
    serial = torch.get_rng_state()
    torch.set_rng_state(state)
    gradmap.tmap(lambda x: (x * w).sum(), torch.ones(16, 3), executor=ex, chunksize=1)
    assert torch.equal(torch.get_rng_state(), serial)
    assert not torch.equal(serial, state)
    torch.set_rng_state(state)
    drawn = gradmap.tmap(lambda x: x + torch.rand(()), torch.ones(16), executor=ex, chunksize=1)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    ref = gradmap.tmap(lambda x: x + torch.rand(()), torch.ones(16), executor="threads")
    assert torch.equal(torch.stack(drawn), torch.stack(ref))
    assert torch.equal(torch.get_rng_state(), after)


def test_a_tiny_map_runs_in_the_caller_alone(ex, monkeypatch):
    # Measured: once a map of f is known to take the caller under TINY, the next sends nothing
    # to the workers; an f whose elements grow goes back to them. (TINY is 5 ms here: at 1 ms,
    # a run of the free-threaded suite under load kept sending this trivial map to the workers.)
    if not ex.caller_helps:
        pytest.skip("the caller does not run chunks")
    monkeypatch.setattr(_local, "TINY", 5e-3)
    me = os.getpid()

    def where(i: int, wait: float) -> int:
        if wait:
            time.sleep(wait)
        return os.getpid()

    calls = [set(gradmap.tmap(where, range(4), [0.0] * 4, executor=ex, chunksize=1))]
    while calls[-1] != {me} and len(calls) < 5:  # the first calls unpickle f in the workers
        calls.append(set(gradmap.tmap(where, range(4), [0.0] * 4, executor=ex, chunksize=1)))
    assert calls[-1] == {me}, calls
    assert set(gradmap.tmap(where, range(4), [0.0] * 4, executor=ex, chunksize=1)) == {me}
    gradmap.tmap(where, range(4), [0.005] * 4, executor=ex, chunksize=1)  # measured: 20 ms
    for _ in range(20):  # the workers take some (not always at once: the caller may be quick)
        if set(gradmap.tmap(where, range(8), [0.005] * 8, executor=ex, chunksize=1)) - {me}:
            break
    else:
        raise AssertionError("a map of 40 ms never reached the workers")


def test_maps_from_two_threads_at_once(ex):
    # Two callers share the workers (and the caller's host, which they take in turns).
    s = Setup()
    ref, ref_y = s.grads(loop)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(3):
                got, got_y = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor=ex, chunksize=2))
                close(got, ref)
                close(got_y, ref_y)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_mlp_on_ragged_bags_matches_loop_with_backward(ex):
    s = Setup()
    ref_ys = loop(s.f(), s.xs)
    sum((i + 1) * y for i, y in enumerate(ref_ys)).backward()
    ref = [t.grad.clone() for t in s.tensors()]
    for t in s.tensors():
        t.grad = None
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    assert all(y.requires_grad for y in ys)
    close([y.detach() for y in ys], [y.detach() for y in ref_ys])
    sum((i + 1) * y for i, y in enumerate(ys)).backward()
    close([t.grad for t in s.tensors()], ref)


def test_closure_tensor_and_non_leaf_made_before_the_call(ex):
    w = torch.randn(3, requires_grad=True)
    c = torch.randn(3, requires_grad=True)
    xs = torch.randn(6, 3)

    def make() -> Any:  # one per path: the first backward frees the non-leaves' graphs
        h = 2 * w  # non-leaf: the gradient must reach w through it
        k = torch.exp(c)
        return lambda x: (torch.sin(x * h) * k).sum() ** 2

    ref = loop(make(), xs)
    got = gradmap.tmap(make(), xs, executor=ex, chunksize=2)
    close(got, ref)
    g = torch.autograd.grad(torch.stack(got).pow(2).sum(), [w, c])
    r = torch.autograd.grad(torch.stack(ref).pow(2).sum(), [w, c])
    assert all(t.abs().sum() > 0 for t in g)
    close(g, r)


def test_items_requiring_grad_leaf_and_non_leaf(ex):
    x0 = torch.randn(6, 3, requires_grad=True)
    leaves = [torch.randn(2, requires_grad=True) for _ in range(6)]
    w = torch.randn(3, requires_grad=True)
    f = lambda x, v: (x * w).sum() * v.sin().sum()  # noqa: E731
    ref = loop(f, x0 * 2, leaves)
    got = gradmap.tmap(f, x0 * 2, leaves, executor=ex, chunksize=2)  # non-leaf rows
    close(got, ref)
    weights = torch.arange(1.0, 7.0)
    inputs = [x0, w, *leaves]
    close(
        torch.autograd.grad((torch.stack(got) * weights).sum(), inputs),
        torch.autograd.grad((torch.stack(ref) * weights).sum(), inputs),
    )


def test_one_tensor_as_item_closure_and_result(ex):
    w = torch.randn(3, requires_grad=True)

    def items() -> list[torch.Tensor]:  # fresh non-leaves per path
        return [w, w * 2, w, torch.tanh(w)]

    f = lambda x: (x, (x * w).sum(), w[1:])  # noqa: E731
    got = gradmap.tmap(f, items(), executor=ex, chunksize=1)
    ref = loop(f, items())

    def loss(out: list[Any]) -> torch.Tensor:
        return sum((i + 1) * (a.sum() + b + c.prod()) for i, (a, b, c) in enumerate(out))

    torch.testing.assert_close(loss(got), loss(ref))
    close(torch.autograd.grad(loss(got), [w]), torch.autograd.grad(loss(ref), [w]))


def test_results_not_requiring_grad(ex):
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(5, 3)
    # A mix: one result leaf requires grad, the others do not.
    f = lambda x: ((x * w).sum(), (x * 3).sum(), x.detach() * w.detach())  # noqa: E731
    got = gradmap.tmap(f, xs, executor=ex, chunksize=2)
    ref = loop(f, xs)
    for g, r in zip(got, ref):
        assert g[0].requires_grad and not g[1].requires_grad and not g[2].requires_grad
        close(g, r)
    # Nothing requires grad at all (grad mode on): plain tensors come back.
    c = torch.randn(3)
    h = lambda x: (x * c).sum()  # noqa: E731
    got = gradmap.tmap(h, xs, executor=ex, chunksize=2)
    assert not any(y.requires_grad for y in got)
    close(got, loop(h, xs))


def test_autograd_grad_with_inputs(ex):
    s = Setup()
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    ref = loop(s.f(), s.xs)
    some = [s.w, s.xs[3], s.a]
    close(
        torch.autograd.grad(outputs=torch.stack(ys).sum(), inputs=some),
        torch.autograd.grad(outputs=torch.stack(ref).sum(), inputs=some),
    )
    # backward(inputs=...): only those accumulate.
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    torch.stack(ys).sum().backward(inputs=[s.w])
    (r,) = torch.autograd.grad(torch.stack(loop(s.f(), s.xs)).sum(), [s.w])
    torch.testing.assert_close(s.w.grad, r)
    assert s.a.grad is None and all(p.grad is None for p in s.model.parameters())


def _stored(ex: Any) -> int:
    return sum(ex.stored_calls())


def test_workers_keep_a_map_only_while_its_graph_waits(ex):
    # A worker forgets a map once it holds none of its chunks; the caller releases what is left.
    # (A fresh f per map: a backward frees the graph of its non-leaf closure tensor.)
    s = Setup()
    assert _stored(ex) == 0
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    assert _stored(ex) == 2  # each worker holds chunks, waiting for the backward
    torch.stack(ys).sum().backward(retain_graph=True)
    assert _stored(ex) == 2  # retain_graph: kept for another backward
    torch.stack(ys).sum().backward()
    assert _stored(ex) == 0  # pulled back and forgotten, with no collection needed
    # Only the first chunk gets a cotangent: the others wait for a backward of their own, as
    # the loop's graphs do (NOTE [a backward of some results]), until the results go.
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    ys[0].backward()
    assert _stored(ex) >= 1
    del ys
    support.collect()
    assert _stored(ex) == 0
    # A graph dropped without a backward.
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    del ys
    support.collect()
    assert _stored(ex) == 0
    # Maps that keep nothing: tsum of losses, no_grad, remat.
    gradmap.tsum(s.f(), s.xs, executor=ex, chunksize=2).backward()
    with torch.no_grad():
        gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2)
    ys = gradmap.tmap(s.f(), s.xs, executor=ex, chunksize=2, remat=True)
    assert _stored(ex) == 0
    torch.stack(ys).sum().backward()
    assert _stored(ex) == 0
    # A forward that fails on its last element: the chunks kept before it are released.
    g = s.f()
    with pytest.raises(ValueError):
        gradmap.tmap(
            lambda i, x: g(x) if i < len(s.xs) - 1 else _raise(ValueError("last")),
            range(len(s.xs)),
            s.xs,
            executor=ex,
            chunksize=2,
        )
    assert _stored(ex) == 0
    works(ex)


def _raise(exc: BaseException) -> Any:
    raise exc


# -- tsum -------------------------------------------------------------------------------------


def test_tsum_of_losses_matches_loop(ex):
    s = Setup()
    total = gradmap.tsum(s.f(), s.xs, executor=ex, chunksize=2)
    ref = loop_sum(s.f(), s.xs)
    torch.testing.assert_close(total, ref)
    close(torch.autograd.grad(total * 3, s.tensors()), torch.autograd.grad(ref * 3, s.tensors()))


@pytest.mark.parametrize("chunksize", [1, 100])  # many chunks; one chunk reaching everything
def test_tsum_gradients_returned_twice_are_independent(ex, chunksize):
    # With cotangent one, a chunk's gradients are handed on as they came; a kept graph must not
    # see what a user's in-place change to a returned gradient did to them.
    s = Setup()
    wrt = s.tensors()
    want = torch.autograd.grad(loop_sum(s.f(), s.xs), wrt)
    total = gradmap.tsum(s.f(), s.xs, executor=ex, chunksize=chunksize)
    first = torch.autograd.grad(total, wrt, retain_graph=True)
    for g in first:
        g.mul_(-7.0)
    close(torch.autograd.grad(total, wrt), want)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_a_worker_sends_the_gradients_of_a_whole_group_once(ex, api):
    # 64 chunks of one element, in groups of 4 (NOTE [chunk-order sum]), all on one worker
    # process: it adds up each group it runs whole and sends one gradient per parameter for
    # it, not one per chunk (the last chunks of a pass, single, are sent one by one).
    alone = gradmap.ProcessExecutor(workers=1, caller_helps=False, timeout=120)
    model = nn.Linear(64, 64)
    per_chunk = sum(p.numel() * p.element_size() for p in model.parameters())  # 16.6 KB
    xs = [torch.randn(2, 64) for _ in range(64)]
    f = lambda x: model(x).pow(2).sum()  # noqa: E731
    worker = alone._pool().ensure(1)[0]
    before = worker.received_bytes
    if api == "tsum":
        got = torch.autograd.grad(
            gradmap.tsum(f, xs, executor=alone, chunksize=1), [*model.parameters()]
        )
    else:
        ys = gradmap.tmap(f, xs, executor=alone, chunksize=1)
        got = torch.autograd.grad(torch.stack(ys).sum(), [*model.parameters()])
    received = worker.received_bytes - before
    assert received < 0.6 * 64 * per_chunk, received / per_chunk
    close(got, torch.autograd.grad(loop_sum(f, xs), [*model.parameters()]))


def test_tsum_of_vectors(ex):
    s = Setup()
    model, w = s.model, s.w

    def make() -> Any:
        b = s.a * 2  # non-leaf, one per path (its graph is freed by the first backward)
        return lambda x: torch.tanh(model[0](x * w + b)).mean(0)  # a vector of 8

    total = gradmap.tsum(make(), s.xs, executor=ex, chunksize=3)
    ref = loop_sum(make(), s.xs)
    assert total.shape == (8,)
    torch.testing.assert_close(total, ref)
    weights = torch.linspace(-1, 2, 8)
    inputs = [*model[0].parameters(), s.w, s.a, *s.xs]
    close(
        torch.autograd.grad((total * weights).sum(), inputs),
        torch.autograd.grad((ref * weights).sum(), inputs),
    )


def test_tsum_of_tuples(ex):
    s = Setup()
    w = s.w

    def make() -> Any:
        f0 = s.f()
        return lambda x: (f0(x), (x * w).sum(0), {"sq": (x**2).sum()})

    total = gradmap.tsum(make(), s.xs, executor=ex, chunksize=3)
    ref = loop_sum(make(), s.xs)
    assert isinstance(total, tuple) and len(total) == 3
    torch.testing.assert_close(total[0], ref[0])
    torch.testing.assert_close(total[1], ref[1])
    torch.testing.assert_close(total[2]["sq"], ref[2]["sq"])

    def loss(t: Any) -> torch.Tensor:
        return t[0] + (t[1] * torch.arange(4.0)).sum() + 0.5 * t[2]["sq"]

    close(
        torch.autograd.grad(loss(total), s.tensors()), torch.autograd.grad(loss(ref), s.tensors())
    )


def test_tsum_with_items_requiring_grad(ex):
    x0 = torch.randn(7, 3, requires_grad=True)
    others = [torch.randn(3, requires_grad=True) for _ in range(7)]
    f = lambda x, o: (x * o).sum().sin()  # noqa: E731
    total = gradmap.tsum(f, torch.exp(x0), others, executor=ex, chunksize=2)  # non-leaf rows
    ref = loop_sum(f, torch.exp(x0), others)
    torch.testing.assert_close(total, ref)
    close(
        torch.autograd.grad(total, [x0, *others]),
        torch.autograd.grad(ref, [x0, *others]),
    )


# -- gradcheck, double backward, remat -------------------------------------------------------


def test_gradcheck_tmap(ex):
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def fn(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            gradmap.tmap(lambda x: torch.sin(x * w).sum() ** 2, xs, executor=ex, chunksize=2)
        )

    assert torch.autograd.gradcheck(fn, (w, xs))


@pytest.mark.parametrize("vector", [False, True], ids=["losses", "vectors"])
def test_gradcheck_tsum(ex, vector):
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def fn(w: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        if vector:
            f = lambda x: torch.sin(x * w) * x.sum()  # noqa: E731
        else:
            f = lambda x: torch.sin(x * w).sum() ** 2  # noqa: E731
        return gradmap.tsum(f, xs, executor=ex, chunksize=2)

    assert torch.autograd.gradcheck(fn, (w, xs))


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_remat_applies_buffer_updates_once(ex, api):
    """BatchNorm in train mode counts its batches in a buffer, which workers update in shared
    memory: the forward counts each element once, as the loop does, and the recompute does
    not count again."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    xs = [torch.randn(2 + i % 3, 3, requires_grad=True) for i in range(10)]
    f = lambda x: (bn(x) ** 2).sum()  # noqa: E731
    if api == "tmap":
        loss = sum(gradmap.tmap(f, xs, executor=ex, chunksize=2, remat=True))
    else:
        loss = gradmap.tsum(f, xs, executor=ex, chunksize=2, remat=True)
    assert bn.num_batches_tracked.item() == len(xs)
    loss.backward()
    assert bn.num_batches_tracked.item() == len(xs)
    assert all(x.grad is not None for x in xs)


# -- shared memory: never stale ---------------------------------------------------------------


def test_optimizer_step_in_place_is_seen(ex):
    s = Setup()
    model = s.model
    xs = [x.detach() for x in s.xs]
    f = lambda x: torch.sin(model(x)).sum() ** 2  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss = gradmap.tsum(f, xs, executor=ex, chunksize=2)
        torch.testing.assert_close(loss, loop_sum(f, xs))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        ref = torch.autograd.grad(loop_sum(f, xs), list(model.parameters()))
        close(grads, ref)
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # tmap too, after the steps
    ys = gradmap.tmap(f, xs, executor=ex, chunksize=2)
    close([y.detach() for y in ys], [y.detach() for y in loop(f, xs)])


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_cpu_autocast_with_its_weight_cache_matches_loop(ex, api):
    """Under the user's autocast region (weight cache on), the caller's own chunks do not take
    the casts an earlier chunk made (NOTE [autocast's cast cache per chunk]); two maps and the
    user's own uses of the model in one region: the loop's gradients, to bfloat16 precision."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    params = list(model.parameters())
    xs = [torch.randn(3, 4) for _ in range(8)]
    f = lambda x: model(x).float().pow(2).mean()  # noqa: E731

    def run(mapped: bool) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = model(xs[0]).float().sum()
            for _ in range(2):
                if not mapped:
                    total = total + loop_sum(f, xs)
                elif api == "tsum":
                    total = total + gradmap.tsum(f, xs, executor=ex, chunksize=1)
                else:
                    ys = gradmap.tmap(f, xs, executor=ex, chunksize=1)
                    assert all(y.dtype == torch.float32 for y in ys)
                    total = total + torch.stack(ys).sum()
            total = total + model(xs[1]).float().sum()
        return list(torch.autograd.grad(total, params))

    want = run(False)
    for got, ref in zip(run(True), want):
        torch.testing.assert_close(got, ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


_CACHED_SCRIPT = """
import functools
import torch
import gradmap


@functools.lru_cache(maxsize=128)
def fib(k):
    return k if k < 2 else fib(k - 1) + fib(k - 2)


@functools.cache
def ramp(k):
    return torch.arange(k, dtype=torch.float32)


w = torch.randn(3, requires_grad=True)
xs = [torch.randn(3) for _ in range(6)]
f = lambda x: (x * w * ramp(3)).sum() * fib(10)
(want,) = torch.autograd.grad(sum(f(x) for x in xs), w)
for ex in (gradmap.ProcessExecutor(workers=2), gradmap.ProcessExecutor(2, caller_helps=False)):
    (got,) = torch.autograd.grad(gradmap.tsum(f, xs, executor=ex, chunksize=2), w)
    assert torch.allclose(got, want), (got, want)
assert fib.cache_info().hits > 0  # the script's own cache, used by its loop
print("ok")
"""


def test_functions_under_lru_cache_travel_with_f(tmp_path):
    """``functools.lru_cache`` and ``functools.cache`` functions of the user's script pickle
    themselves by name, which a worker cannot load; they travel by value, recursion included,
    each worker with a cache of its own (a fresh interpreter)."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(_CACHED_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


class _Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized_model() -> nn.Module:
    torch.manual_seed(5)
    custom = nn.Linear(4, 4)
    nn.utils.parametrize.register_parametrization(custom, "weight", _Symmetric())
    return nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)),
        nn.Tanh(),
        nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)),
        nn.Tanh(),
        custom,
    )


def test_parametrized_modules_match_the_loop_across_optimizer_steps(ex):
    """Modules with parametrizations (whose classes refuse to pickle, PyTorch asking for
    ``state_dict``) travel rebuilt from their class and attributes; the originals' gradients
    and in-place optimizer steps are the loop's."""
    ref, mapped = _parametrized_model(), _parametrized_model()
    xs = [torch.randn(3, 4) for _ in range(6)]
    steps = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mapped)]
    for api in ("tsum", "tmap", "tsum"):
        for step in steps:
            step.zero_grad()
        loop_sum(lambda x: ref(x).pow(2).mean(), xs).backward()
        f = lambda x: mapped(x).pow(2).mean()  # noqa: E731
        if api == "tsum":
            gradmap.tsum(f, xs, executor=ex, chunksize=2).backward()
        else:
            torch.stack(gradmap.tmap(f, xs, executor=ex, chunksize=2)).sum().backward()
        close([p.grad for p in mapped.parameters()], [p.grad for p in ref.parameters()])
        for step in steps:
            step.step()


def test_running_statistics_in_train_mode_are_told_once(ex, monkeypatch):
    """BatchNorm in train mode updates its running statistics from several processes at once
    (NOTE [running statistics on worker processes]): the first map of such an ``f`` says so;
    the same model in eval mode, and later maps, say nothing."""
    from gradmap._remote import _map

    monkeypatch.setattr(_map, "_WARNED_STATISTICS", set())
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    xs = [torch.randn(5, 3) for _ in range(6)]
    f = lambda x: model(x).pow(2).mean()  # noqa: E731
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradmap.tsum(f, xs, executor=ex, chunksize=2)
    model.train()
    with pytest.warns(RuntimeWarning, match=r"running statistics.*eval\(\) mode") as told:
        gradmap.tsum(f, xs, executor=ex, chunksize=2)
    assert told[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradmap.tsum(f, xs, executor=ex, chunksize=2)


def test_a_map_takes_one_draw_from_the_generator(ex):
    """NOTE [the generator after a map] (``_torch/_random``): after a map on processes of an
    ``f`` that draws nothing, or one that draws, the caller's generator is one draw on, as on
    threads: what the program draws next is the same whatever executor ran the map."""
    w = torch.ones(3, requires_grad=True)
    xs = [torch.full((3,), float(i)) for i in range(8)]
    for f in (lambda x: (x * w).sum(), lambda x: (x * w).sum() + torch.rand(())):
        torch.manual_seed(3)
        gradmap.tsum(f, xs, executor="serial", chunksize=2)
        want = float(torch.rand(()))
        for _ in range(2):
            torch.manual_seed(3)
            gradmap.tsum(f, xs, executor=ex, chunksize=2)
            assert float(torch.rand(())) == want


def test_a_generator_f_holds_is_refused_and_one_per_item_is_not(ex):
    """``f`` drawing from a ``torch.Generator`` it holds: each worker would draw from a copy in
    one state (the same numbers on every worker, silently); refused, naming the fixes. A
    generator per element, passed as an item, draws as in the loop."""
    xs = [torch.randn(4, requires_grad=True) for _ in range(8)]
    gen = torch.Generator().manual_seed(5)
    with pytest.raises(RuntimeError, match=r"torch\.Generator of its own"):
        gradmap.tmap(lambda x: (x * torch.randn(4, generator=gen)).sum(), xs, executor=ex)
    gens = [torch.Generator().manual_seed(i) for i in range(8)]

    def f(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        return (x * torch.randn(4, generator=g)).sum()

    want = loop(f, xs, gens)
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    close(gradmap.tmap(f, xs, gens, executor=ex), want)


def test_a_large_pickle_of_f_is_told_once(ex, monkeypatch):
    """Data ``f`` holds that is not a tensor travels in ``f``'s pickle, made on every call: the
    first call says so (size, time, the fix), later calls of the same ``f`` do not."""
    import numpy as np

    from gradmap._remote import _map

    monkeypatch.setattr(_map, "_WARNED_HEAVY", set())  # (told once a process: per executor here)

    lin = nn.Linear(3, 1)
    table = np.linspace(0.0, 1.0, 600_000)  # 4.6 MiB of float64

    def f(x: torch.Tensor) -> torch.Tensor:
        return lin(x).sum() * float(table[7])

    xs = [torch.randn(3) for _ in range(6)]
    with pytest.warns(RuntimeWarning, match=r"f pickles to 4\.\d MiB.*torch\.tensor\(a\)") as told:
        total = gradmap.tsum(f, xs, executor=ex, chunksize=2)
    assert told[0].filename == __file__  # the user's line
    torch.testing.assert_close(total, loop_sum(f, xs))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradmap.tsum(f, xs, executor=ex, chunksize=2)


def test_swapped_data_and_in_place_constants_are_seen(ex):
    lin = nn.Linear(3, 2)
    c = torch.randn(2)  # a closure constant (no grad): in shared memory too
    xs = torch.randn(6, 3)
    f = lambda x: (torch.tanh(lin(x)) * c).sum()  # noqa: E731

    def check() -> None:
        ys = gradmap.tmap(f, xs, executor=ex, chunksize=2)
        ref = loop(f, xs)
        close([y.detach() for y in ys], [y.detach() for y in ref])
        close(
            torch.autograd.grad(torch.stack(ys).sum(), list(lin.parameters())),
            torch.autograd.grad(torch.stack(ref).sum(), list(lin.parameters())),
        )

    check()
    for p in lin.parameters():
        p.data = torch.randn_like(p)  # a new storage
    check()
    for p in lin.parameters():
        p.data = torch.randn_like(p)  # and another
    check()
    with torch.no_grad():
        c.mul_(-3)
        lin.weight.add_(1.0)
    check()
    c.data = torch.randn(2)
    check()


@pytest.mark.parametrize("remat", [False, True])
def test_a_tensor_changed_in_place_before_the_backward_raises_as_in_the_loop(ex, remat):
    """NOTE [tensors changed in place before a backward]: the workers' graphs read ``w`` in
    shared memory; changed in place after the forward, the backward raises PyTorch's error,
    as the loop's does, instead of differentiating at the new value. Changed after the
    backward (an optimizer's step), the next call is as the loop."""
    w = torch.randn(4, 4, requires_grad=True)
    scale = torch.full((4,), 2.0)  # a closure tensor that does not require grad, saved too
    f = lambda x: ((w * w * scale) @ x).tanh().sum()  # noqa: E731
    xs = [torch.randn(4) for _ in range(8)]
    for changed in (w, scale):
        for make in (
            lambda: sum(loop(f, xs)),
            lambda: sum(gradmap.tmap(f, xs, executor=ex, chunksize=2, remat=remat)),
        ):
            loss = make()
            with torch.no_grad():
                changed.mul_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    with torch.no_grad():
        w.sub_(0.1)  # between calls: seen, no error
    ref = torch.autograd.grad(sum(loop(f, xs)), w)
    got = torch.autograd.grad(sum(gradmap.tmap(f, xs, executor=ex, chunksize=2, remat=remat)), w)
    close(got, ref)


def test_changed_python_closure_is_seen(ex):
    w = torch.randn(3, requires_grad=True)
    state = {"scale": 1.0}
    f = lambda x: (x * w).sum() * state["scale"]  # noqa: E731
    xs = torch.randn(4, 3)
    for scale in (1.0, 5.0, -2.0):
        state["scale"] = scale
        got = gradmap.tmap(f, xs, executor=ex, chunksize=2)
        close([y.detach() for y in got], [y.detach() for y in loop(f, xs)])


def test_items_in_shared_memory_travel_by_reference(ex):
    from gradmap._process._shared import Sharer
    from gradmap._remote._pickling import TensorTable, dumps

    w = torch.randn(4, requires_grad=True)
    xs = [torch.randn(3, 4) for _ in range(6)]
    plain = dumps(xs[:2], TensorTable(Sharer()))
    for x in xs:
        x.share_memory_()
    shared = dumps(xs[:2], TensorTable(Sharer()))
    assert not plain.keys and len(shared.keys) == 2  # by reference: no bytes of the rows
    assert len(shared) < len(plain) - 2 * 3 * 4 * 4 + 64
    f = lambda x: (x @ w).tanh().sum()  # noqa: E731
    ref = torch.autograd.grad(torch.stack(loop(f, xs)).sum(), [w])
    for _ in range(2):  # the second call: the workers hold the storages already
        got = torch.autograd.grad(torch.stack(gradmap.tmap(f, xs, executor=ex)).sum(), [w])
        close(got, ref)
    with torch.no_grad():
        xs[0].mul_(2.0)  # an in-place change of a shared item reaches the next call
    ref = torch.autograd.grad(torch.stack(loop(f, xs)).sum(), [w])
    got = torch.autograd.grad(gradmap.tsum(f, xs, executor=ex), [w])
    close(got, ref)


def test_pyro_params_on_processes_are_refused_naming_the_param_store(ex):
    """``pyro.param`` inside f: each worker has its own param store, whose parameters never
    reach the caller. The error names the store and the parameter, and advises passing the
    parameters in or ``executor='serial'``, not threads (one store for all of them)."""
    pyro = pytest.importorskip("pyro")
    dist = pytest.importorskip("pyro.distributions")

    def model(x: torch.Tensor) -> torch.Tensor:
        loc = pyro.param("loc", torch.tensor(0.0, dtype=torch.float64))
        return dist.Normal(loc, 1.0).log_prob(x).sum()

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with pytest.raises(gradmap.ForeignTensorError) as caught:
        gradmap.tmap(model, xs, executor=ex, chunksize=2)
    text = str(caught.value)
    assert "pyro's param store's parameter 'loc'" in text, text
    assert "one per process" in text and "executor='serial'" in text, text
    assert "pyro.nn.PyroModule" in text, text
    assert "executor='threads'" not in text, text
    pyro.clear_param_store()


def test_a_tensor_f_caches_in_a_module_is_named_where_the_worker_holds_it(ex):
    """f caches a leaf in a module's global dict, on the worker: the error says where the
    worker holds it (NOTE [where a foreign tensor lives])."""

    def f(x: torch.Tensor) -> torch.Tensor:
        if "w" not in support.CACHE:
            support.CACHE["w"] = torch.ones(3, dtype=torch.float64, requires_grad=True)
        return (x * support.CACHE["w"]).sum()

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    told = r"held by the worker at support\.CACHE\['w'\]"
    try:
        with pytest.raises(gradmap.ForeignTensorError, match=told):
            gradmap.tmap(f, xs, executor=ex, chunksize=4)
    finally:
        support.CACHE.clear()


#: A global whose name is also an attribute of a package f's module imports (``torch.ops``).
ops = nn.ModuleDict({"lin": nn.Linear(3, 2).double()})


def _uses_ops(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(ops["lin"](x)).sum()


def test_a_global_named_as_a_submodule_of_an_imported_package(ex):
    """f names the global ``ops`` (a ModuleDict) beside ``import torch``: cloudpickle took it
    for the submodule ``torch.ops``, which does not pickle, and gradmap said f must be
    picklable (NOTE [the submodules a function names])."""
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]
    params = list(ops.parameters())
    want = torch.autograd.grad(sum(loop(_uses_ops, xs)), params)
    ys = gradmap.tmap(_uses_ops, xs, executor=ex, chunksize=2)
    close(ys, loop(_uses_ops, xs))
    close(torch.autograd.grad(sum(ys), params), want)


@pytest.mark.parametrize("remat", [False, True])
def test_jagged_nested_results_get_the_loops_gradients(ex, remat):
    """f returns a jagged nested tensor: the result and its cotangent each cross a pickle,
    whose offsets are new ones with another nested int, and the worker's engine refused the
    cotangent (NOTE [jagged results' nested ints] in ``_torch/_chunk``)."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    f = lambda x: torch.nested.as_nested_tensor([x[:2] * w[:2], (x * w).sin()], layout=torch.jagged)  # noqa: E731
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(5)]

    def loss(ys: list[torch.Tensor]) -> torch.Tensor:
        return sum((i + 1) * (y.values() ** 2).sum() for i, y in enumerate(ys))

    want = torch.autograd.grad(loss(loop(f, xs)), w)
    ys = gradmap.tmap(f, xs, executor=ex, chunksize=2, remat=remat)
    assert all(y.layout == torch.jagged for y in ys)
    close(torch.autograd.grad(loss(ys), w), want)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_sparse_items_and_a_sparse_parameter(ex):
    """Sparse tensors have no one storage: items and closure tensors of a sparse layout pickle
    as torch pickles them, and a sparse parameter gets the loop's (sparse) gradient."""
    w = torch.randn(4, 4, requires_grad=True)
    ws = torch.randn(4, 4).relu().to_sparse().requires_grad_()
    coo = [torch.randn(4, 4).relu().to_sparse() for _ in range(5)]
    csr = [torch.randn(4, 4).relu().to_sparse_csr() for _ in range(5)]
    f = lambda s, c, x: torch.sparse.mm(s, w).sum() + (c @ w).sum() + torch.sparse.mm(ws, x).sum()  # noqa: E731
    xs = [torch.randn(4, 1) for _ in range(5)]
    ref = torch.autograd.grad(sum(loop(f, coo, csr, xs)), [w, ws])
    got = torch.autograd.grad(gradmap.tsum(f, coo, csr, xs, executor=ex, chunksize=2), [w, ws])
    assert got[1].layout == torch.sparse_coo
    close([got[0], got[1].to_dense()], [ref[0], ref[1].to_dense()])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_fresh_closure_tensors_do_not_accumulate(ex):
    # A training loop: each step's f closes over that step's tensors (targets, masks). Once a
    # step is over, nothing of them may stay behind (each shared storage holds a descriptor).
    w = torch.randn(3, requires_grad=True)
    xs = torch.randn(4, 3)

    def step() -> None:
        target = torch.randn(3)
        loss = gradmap.tsum(lambda x: ((x * w).sum() - target[0]) ** 2, xs, executor=ex)
        loss.backward()
        torch.testing.assert_close(
            loss.detach(), sum(((x * w).sum() - target[0]) ** 2 for x in xs).detach()
        )

    step()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(40):
        step()
    grown = len(os.listdir("/proc/self/fd")) - before
    assert grown < 10, f"{grown} more open file descriptors after 40 steps"


# -- random numbers ---------------------------------------------------------------------------


def test_random_f_under_no_grad_draws_as_threads_run_after_run(ex):
    """Under no_grad too, each element draws from its own seed: the same values as threads and
    serial, and the same in every run with the same seed (a worker did not seed there)."""
    xs = ragged(grad=False)
    f = lambda x: x.sum(0) + torch.rand(4)  # noqa: E731

    def run(executor: Any) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        with torch.no_grad():
            ys = torch.stack(gradmap.tmap(f, xs, executor=executor, chunksize=3))
        return ys, torch.rand(2)  # the caller's generator goes on where threads leave it

    first, second = run(ex), run(ex)
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, run("threads"))
    torch.testing.assert_close(first, run("serial"))


def test_the_callers_tensors_are_left_as_they_were(ex):
    """Items, plain and requiring grad: after maps on processes, the caller's tensors can still
    be resized (numpy's view of a tensor, which pickling used, marks its storage not resizable
    for good), as after the loop. (Tensors f refers to move to shared memory, as docs/executors.md
    says.)"""
    c = torch.randn(3)
    xs = [torch.randn(3) for _ in range(6)] + [torch.randn(3, 2)[:, 0], torch.randn(3).conj()]
    ws = [torch.randn(3, requires_grad=True) for _ in range(8)]
    ys = gradmap.tmap(lambda x, w: (x * w * c).sum(), xs, ws, executor=ex, chunksize=2)
    torch.stack(ys).sum().backward()
    for _ in range(2):  # the second call: the items are kept (their bytes compared)
        gradmap.tmap(lambda x: x * 2, xs, executor=ex, chunksize=2)
    for t in (*xs[:6], *ws):
        assert t.untyped_storage().resizable()


def test_inference_mode_with_parameters(ex):
    """Under inference_mode the caller's own chunks load the payloads as inference tensors,
    which count no versions (that raised)."""
    w = nn.Parameter(torch.randn(3))
    xs = [torch.randn(3) for _ in range(8)]

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x * w).sum()

    with torch.inference_mode():
        want = torch.stack([f(x) for x in xs])
        got = torch.stack(gradmap.tmap(f, xs, executor=ex, chunksize=2))
        total = gradmap.tsum(f, xs, executor=ex, chunksize=2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(total, want.sum())


def test_random_tsum_matches_threads(ex):
    xs = ragged(grad=False)
    w = torch.randn(4, requires_grad=True)
    f0 = noisy(w)
    f = lambda x: f0(x)[0]  # noqa: E731

    def run(executor: Any) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(2)
        total = gradmap.tsum(f, xs, executor=executor, chunksize=3)
        (g,) = torch.autograd.grad(total, [w])
        return total.detach(), g

    t_total, t_g = run("threads")
    p_total, p_g = run(ex)
    torch.testing.assert_close(p_total, t_total)
    torch.testing.assert_close(p_g, t_g)


# -- errors -----------------------------------------------------------------------------------


def test_unpicklable_f_says_f_must_be_picklable(ex):
    lock = threading.Lock()
    w = torch.randn(3, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        with lock:
            return (x * w).sum()

    for api in (gradmap.tmap, gradmap.tsum):
        with pytest.raises(Exception) as info:
            api(f, torch.ones(4, 3), executor=ex)
        text = str(info.value) + "\n" + notes(info.value)
        assert "f must be picklable" in text, text
        del info
    works(ex)


def test_unpicklable_item_names_the_element(ex):
    w = torch.randn(3, requires_grad=True)
    tags: list[Any] = ["ok"] * 8
    tags[5] = threading.Lock()
    f = lambda x, tag: (x * w).sum()  # noqa: E731
    for api in (gradmap.tmap, gradmap.tsum):
        with pytest.raises(Exception) as info:
            api(f, torch.ones(8, 3), tags, executor=ex, chunksize=2)
        text = str(info.value) + "\n" + notes(info.value)
        assert "element 5" in text, text
        del info
    works(ex)


# -- dead workers -----------------------------------------------------------------------------


def _lossy(s: Setup, forward_marker: str | None, backward_marker: str | None) -> Any:
    model, w = s.model, s.w
    b = s.a * 2

    def f(i: int, x: torch.Tensor) -> torch.Tensor:
        # The first element to run in a worker process (not the caller's) waits to be killed.
        if forward_marker is not None and mark(forward_marker):
            time.sleep(60)
        h = SlowBackward.apply(x * w + b, backward_marker)
        return torch.sin(model(h)).sum() ** 2

    return f


def _died(exc: BaseException) -> bool:
    text = (str(exc) + "\n" + notes(exc)).lower()
    return "died" in text or "lost" in text


@pytest.mark.parametrize("phase", ["forward", "backward"])
@deadline(90, main_thread=True)
def test_worker_killed_while_running(ex, tmp_path, phase):
    s = Setup()
    idx = range(len(s.xs))
    ref_f = _lossy(s, None, None)
    ref_ys = loop(ref_f, idx, s.xs)
    ref = torch.autograd.grad(sum((i + 1) * y for i, y in enumerate(ref_ys)), s.tensors())
    pids = _pids(ex)
    marker = tmp_path / "pid"
    killer = Killer(marker, pids)
    markers = (str(marker), None) if phase == "forward" else (None, str(marker))
    f = _lossy(s, *markers)
    try:
        ys = gradmap.tmap(f, idx, s.xs, executor=ex, chunksize=2)
        close([y.detach() for y in ys], [y.detach() for y in ref_ys])
        got = torch.autograd.grad(sum((i + 1) * y for i, y in enumerate(ys)), s.tensors())
    except Exception as exc:  # a clear error is allowed; a wrong gradient or a hang is not
        assert _died(exc), f"{type(exc).__name__}: {exc}\n{notes(exc)}"
    else:
        close(got, ref)
    finally:
        killer.join()
    assert not killer.strangers, killer.strangers
    assert len(killer.killed) == 1
    works(ex)
    after = _pids(ex)  # the killed worker was replaced by a new process
    assert killer.killed[0] not in after and len(after) == 2


def _tagged(f: Any) -> Any:
    """``f`` that also returns the pid of the process it ran in (its chunk's owner)."""
    return lambda x: (f(x), os.getpid())


@pytest.mark.parametrize("victims", ["one", "all"])
@deadline(90, main_thread=True)
def test_worker_killed_between_forward_and_backward(ex, victims):
    s = Setup()
    ref, ref_y = s.grads(loop)
    out = gradmap.tmap(_tagged(s.f()), s.xs, executor=ex, chunksize=2)
    ys, owners = [o[0] for o in out], {o[1] for o in out} - {os.getpid()}  # not the caller
    assert owners <= set(_pids(ex))
    killed = sorted(owners)[:1] if victims == "one" else sorted(owners)
    for pid in killed:  # workers that hold graphs of this map
        os.kill(pid, signal.SIGKILL)
    loss = sum((i + 1) * y for i, y in enumerate(ys))
    try:
        got = torch.autograd.grad(loss, s.tensors())
    except Exception as exc:  # a clear error is allowed; a wrong gradient or a hang is not
        assert _died(exc), f"{type(exc).__name__}: {exc}\n{notes(exc)}"
    else:
        close(got, ref)
    close([y.detach() for y in ys], ref_y)
    del ys, loss, out
    works(ex)
    after = _pids(ex)
    assert not set(killed) & set(after), f"killed {killed}; after: {after}"


@deadline(90, main_thread=True)
def test_worker_killed_between_forward_and_backward_tsum_vectors(ex):
    s = Setup()
    model, w = s.model, s.w
    f = lambda x: torch.tanh(model[0](x * w)).mean(0)  # noqa: E731  (kept on the workers)
    total = gradmap.tsum(f, s.xs, executor=ex, chunksize=2)
    ref = loop_sum(f, s.xs)
    victim = _pids(ex)[1]
    os.kill(victim, signal.SIGKILL)
    weights = torch.linspace(-1, 2, 8)
    inputs = [*model[0].parameters(), w, *s.xs]
    try:
        got = torch.autograd.grad((total * weights).sum(), inputs)
    except Exception as exc:
        assert _died(exc), f"{type(exc).__name__}: {exc}\n{notes(exc)}"
    else:
        close(got, torch.autograd.grad((ref * weights).sum(), inputs))
    works(ex)
    assert victim not in _pids(ex)


def _sleepy(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 100:
        time.sleep(60)  # an f stuck on one element
    return x.sum() * 2


@support.deadline(90)
def test_a_map_that_times_out_stops_its_stuck_worker():
    """``timeout``: a map in which no chunk finishes in time raises ``TimeoutError`` and stops
    the workers still running ``f``; the next map runs at once on new ones (it waited behind
    the stuck call, and timed out again, until ``f`` returned)."""
    own = gradmap.ProcessExecutor(workers=1, caller_helps=False, timeout=2)
    try:
        xs = [torch.ones(3) for _ in range(4)]
        gradmap.tmap(_sleepy, xs, executor=own)  # the worker is up
        (stuck,) = own.worker_pids()
        bad = list(xs)
        bad[2] = torch.full((3,), 100.0)
        with pytest.raises(TimeoutError, match="stopped"):
            gradmap.tmap(_sleepy, bad, executor=own)
        start = time.monotonic()
        close(gradmap.tmap(_sleepy, xs, executor=own), loop(_sleepy, xs))
        assert time.monotonic() - start < 30
        assert stuck not in own.worker_pids()
        assert _state(stuck) in (None, "Z", "X")
    finally:
        own.shutdown()


def test_timeout_does_not_count_a_worker_starting(monkeypatch):
    """NOTE [a worker starting]: a worker's import is not ``f``'s time; a call to it that the
    worker is too slow to start for fails only once the start passes ``start_timeout``."""
    from gradmap._process import _workers

    monkeypatch.setattr(_workers, "_COMMAND", "import time; time.sleep(3); " + _workers._COMMAND)
    own = gradmap.ProcessExecutor(workers=1, caller_helps=False, threads_per_worker=3, timeout=1)
    try:
        xs = [torch.ones(3) for _ in range(4)]
        close(gradmap.tmap(lambda x: x * 2, xs, executor=own), [torch.full((3,), 2.0)] * 4)
    finally:
        own.shutdown()
    slow = gradmap.ProcessExecutor(
        workers=1, caller_helps=False, threads_per_worker=3, timeout=1, start_timeout=0.5
    )
    try:
        with pytest.raises(TimeoutError, match="no chunk finished"):
            gradmap.tmap(lambda x: x * 2, xs, executor=slow)
    finally:
        slow.shutdown()


def test_an_executor_in_a_with_block_stops_its_workers_at_its_end():
    with gradmap.ProcessExecutor(workers=1, caller_helps=False, timeout=120) as own:
        got = gradmap.tmap(lambda x: x * 2, torch.ones(3, 2), executor=own)
        pids = own.worker_pids()
    close(got, [torch.full((2,), 2.0)] * 3)
    time.sleep(0.5)
    assert all(_state(pid) in (None, "Z", "X") for pid in pids)


def test_workers_outlive_the_thread_that_started_them(ex):
    # A map called from a thread (a data loader's, a server's) starts the workers there; they
    # must not die when that thread exits (Linux's parent-death signal follows the thread).
    own = gradmap.ProcessExecutor(workers=1, threads_per_worker=2, timeout=120)  # its own pool
    try:
        caller = threading.Thread(
            target=gradmap.tmap, args=(lambda x: x * 2, torch.ones(2, 3)), kwargs={"executor": own}
        )
        caller.start()
        caller.join(60)
        pids = own.worker_pids()
        _SEEN_PIDS.update(pids)
        time.sleep(0.5)
        dead = [pid for pid in pids if _state(pid) in (None, "Z", "X")]
        assert not dead, f"workers {dead} died when the thread that started them exited"
        gradmap.tmap(lambda x: x * 2, torch.ones(2, 3), executor=own)
        assert own.worker_pids() == pids  # the same processes serve the next map
    finally:
        own.shutdown()


def _state(pid: int) -> str | None:
    """A process's state letter (``"Z"``: a zombie), or ``None`` if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# -- names, arguments, nesting ----------------------------------------------------------------


@deadline(90, main_thread=True)
def test_executor_name_processes(ex):
    s = Setup()
    ref, ref_y = s.grads(loop)
    got, got_y = s.grads(lambda f, xs: gradmap.tmap(f, xs, executor="processes", chunksize=2))
    close(got_y, ref_y)
    close(got, ref)
    total = gradmap.tsum(s.f(), s.xs, executor="processes", chunksize=2)
    torch.testing.assert_close(total, loop_sum(s.f(), s.xs))
    # Not a tiny map (which would run in the caller alone): 5 ms per element.
    where = lambda i: (time.sleep(0.005), os.getpid())[1]  # noqa: E731
    pids = set(gradmap.tmap(where, range(4), executor="processes", chunksize=1))
    assert pids - {os.getpid()}  # a worker process ran some (the caller may run others)
    _SEEN_PIDS.update(pids - {os.getpid()})


def test_bad_arguments():
    with pytest.raises(ValueError, match="workers"):
        gradmap.ProcessExecutor(workers=0)
    with pytest.raises(ValueError, match="workers"):
        gradmap.ProcessExecutor(workers=-1)
    with pytest.raises(ValueError, match="threads_per_worker"):
        gradmap.ProcessExecutor(threads_per_worker=0)
    assert "ProcessExecutor(workers=3" in repr(gradmap.ProcessExecutor(workers=3))


@pytest.mark.parametrize("inner", [None, "processes"])
def test_nested_tmap_runs_on_the_worker(ex, inner):
    xs = ragged(n=6)
    w = torch.randn(4, requires_grad=True)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, int, list[int]]:
        rows = gradmap.tmap(lambda r: torch.sin(r * w).sum(), x, executor=inner)
        where = gradmap.tmap(lambda r: os.getpid(), x, executor=inner)
        total = gradmap.tsum(lambda r: (r * w).cos().sum(), x, executor=inner)
        return torch.stack(rows).pow(2).sum() + total, os.getpid(), where

    got = gradmap.tmap(f, xs, executor=ex, chunksize=2)
    ref = loop(f, xs)
    pids = {*_pids(ex), os.getpid()}  # the workers, and the caller (its chunks run as theirs)
    for (y, pid, where), (r, _, _) in zip(got, ref):
        assert pid in pids
        assert set(where) == {pid}  # the inner map ran in the worker itself
        torch.testing.assert_close(y, r)
    loss = lambda out: sum((i + 1) * o[0] for i, o in enumerate(out))  # noqa: E731
    close(torch.autograd.grad(loss(got), [w, *xs]), torch.autograd.grad(loss(ref), [w, *xs]))


@pytest.mark.parametrize("outer", ["threads", "user-pool"])
@support.deadline(120)
def test_a_map_on_processes_inside_a_map_on_threads(ex, outer):
    """f, run on threads, maps on processes: the inner map runs (it hung: the outer map holds
    the generator's lock while its chunks run, and the inner map took it again)."""
    w = torch.randn(3, requires_grad=True)

    def inner(x: float) -> torch.Tensor:
        return (w * x).sin().sum()

    def f(x: int) -> torch.Tensor:
        return torch.stack(gradmap.tmap(inner, [x * 10.0 + j for j in range(4)], executor=ex)).sum()

    def run(mapper: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ys = torch.stack(mapper(f, range(6)))
        return ys.detach(), torch.autograd.grad(ys.sum(), w)[0]

    with support.executor_kwargs(outer) as (kwargs, _):
        got = run(lambda f, xs: gradmap.tmap(f, xs, **kwargs))
    close(got, run(loop))


# -- shutdown: last, no process left behind ---------------------------------------------------


def _gone(pid: int, timeout: float = 10.0) -> bool:
    stop = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > stop:
            return False
        time.sleep(0.05)


def test_shutdown_leaves_no_process_and_restarts(ex):
    pids = _pids(ex)
    ex.shutdown()
    left = [pid for pid in sorted(_SEEN_PIDS) if not _gone(pid)]
    assert not left, f"worker processes alive (or unreaped) after shutdown: {left}"
    # The next map starts new workers.
    works(ex)
    fresh = _pids(ex)
    assert not set(fresh) & set(pids)
    ex.shutdown()
    assert all(_gone(pid) for pid in fresh)


_MAIN_SCRIPT = """
import torch, gradmap
from torch import nn

P = nn.Parameter(torch.ones(3, dtype=torch.float64))
SCALE = 1.0


class Net(nn.Module):
    def forward(self, x):
        return (x * P * SCALE).sum()


net = Net()
xs = [torch.randn(3, dtype=torch.float64) for _ in range(8)]  # float64: sums in other orders


def loop_grad():
    P.grad = None
    sum(net(x) for x in xs).backward()
    return P.grad.clone()


before = loop_grad()
forward = Net.forward
for api in ("tmap", "tsum"):
    if api == "tmap":
        total = torch.stack(gradmap.tmap(net, xs, executor="processes", chunksize=1)).sum()
    else:
        total = gradmap.tsum(net, xs, executor="processes", chunksize=1)
    P.grad = None
    total.backward()
    assert torch.allclose(P.grad, before), (api, P.grad, before)
    assert Net.forward is forward and Net.forward.__globals__ is globals(), api
    assert torch.equal(loop_grad(), before), api  # the loop after a map: as before it
SCALE = 2.0  # a script setting changed later is seen by the loop and by the map
assert torch.allclose(loop_grad(), 2 * before)
P.grad = None
gradmap.tsum(net, xs, executor="processes", chunksize=1).backward()
assert torch.allclose(P.grad, 2 * before)
print("ok")
"""


def test_a_map_leaves_the_callers_own_classes_as_they_are(tmp_path):
    """A class of the user's script whose method reads a global parameter: after maps on
    processes (the caller running chunks too), the class, its methods and their globals are the
    script's own, and the loop's gradients are what they were (a fresh interpreter)."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(_MAIN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_CLASSES_SCRIPT = """
import collections
import enum
import numpy as np
import torch, gradmap
from torch import nn

P = nn.Parameter(torch.ones(3, dtype=torch.float64))
arr = np.ones(3)
K = torch.from_numpy(arr)  # shares the array's memory
W = nn.Parameter(torch.ones(3, dtype=torch.float64))
Wn = W.detach().numpy()  # a numpy alias of a parameter, taken before the maps


class Color(enum.Enum):
    RED = 1


class Box:
    def __init__(self, v):
        self.v = v

    def total(self):
        return (self.v * P).sum()


class Bad(Exception):
    pass


NT = collections.namedtuple("NT", ["v", "k"])


class Tagged(torch.Tensor):
    pass


def f(i, x):
    if i == 5 and x.sum() > 100:  # (only the call below that asks for it)
        raise Bad(i)
    return Box(torch.sin(x * K * W).detach()), Color.RED  # (no graph inside an object)


def g(box):
    return box.total()


xs = [torch.randn(3, dtype=torch.float64) for _ in range(12)]
total = Box.total
for helps in (True, False):
    ex = gradmap.ProcessExecutor(2, caller_helps=helps)
    for _ in range(2):
        ys = gradmap.tmap(f, range(12), xs, executor=ex, chunksize=1)
        assert all(type(b) is Box and c is Color.RED for b, c in ys), helps
        assert Box.total is total and Box.total.__globals__ is globals(), helps
    ys = gradmap.tmap(lambda x: NT(x * 2, 3), xs, executor=ex, chunksize=1)
    assert all(type(y) is NT for y in ys), helps  # a named tuple of the script's: a container
    boxes = [Box(x) for x in xs]  # items of the script's own class
    got = gradmap.tsum(g, boxes, executor=ex, chunksize=1)
    P.grad = None
    got.backward()
    assert torch.allclose(P.grad, sum(xs)), helps
    tagged = [x.as_subclass(Tagged) for x in xs]  # results of the script's tensor subclass
    got = gradmap.tsum(lambda x: (x * P).sum(), tagged, executor=ex, chunksize=1)
    assert type(got) is Tagged, (helps, type(got))
    P.grad = None
    got.backward()
    assert torch.allclose(P.grad, sum(xs)), helps
    try:
        gradmap.tmap(f, range(12), [x + 1000 for x in xs], executor=ex, chunksize=1)
    except Bad as e:
        assert e.args == (5,), e.args
    else:
        raise SystemExit("no error")
    arr[:] = 2.0  # seen through K by the next map, as in the loop
    ys = gradmap.tmap(f, range(12), xs, executor=ex, chunksize=1)
    assert all(torch.allclose(b.v, torch.sin(x * 2)) for (b, _), x in zip(ys, xs)), helps
    assert torch.equal(K, torch.full((3,), 2.0, dtype=torch.float64))
    arr[:] = 1.0
    Wn[:] = 1.0  # writes W, as in the loop
    assert Wn.__array_interface__["data"][0] == W.data_ptr()
    ex.shutdown()
print("ok")
"""


def test_the_scripts_own_classes_and_numpy_memory_stay_the_users(tmp_path):
    """In a fresh interpreter, with classes of the script (``__main__``) and numpy memory shared
    with tensors f uses, on processes with and without the caller running chunks (NOTE [the
    user's classes stay theirs]): results are of the script's own classes (those of the
    caller's chunks were copies), receiving them rebinds no method (it did: methods of the
    script's classes read copies of its globals after), an exception of the script's class is
    caught by ``except``, items of the script's classes reach the workers (they did not
    unpickle), and a tensor sharing a numpy array's memory keeps sharing it (moved to shared
    memory, ``torch.from_numpy``'s tensor stopped seeing the array, and a ``.numpy()`` alias
    pointed at freed memory)."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(_CLASSES_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_WARNINGS_SCRIPT = """
import warnings

import torch

import gradmap
from gradmap._process import _local

_local.TINY = 0.0  # (maps of a few elements reach the workers)


def f(x):
    warnings.warn("gradmap test: filtered away", FutureWarning)
    warnings.warn("gradmap test: shown", UserWarning)
    return (x * 2).sum()


warnings.filterwarnings("ignore", message="gradmap test: filtered", category=FutureWarning)
xs = [torch.randn(3) for _ in range(4)]
for helps in (False, True):
    ex = gradmap.ProcessExecutor(workers=2, caller_helps=helps)
    gradmap.tmap(f, xs, executor=ex, chunksize=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        try:
            gradmap.tmap(f, xs, executor=ex, chunksize=1)
        except UserWarning as e:
            print("raised", e)
    gradmap.tmap(f, xs, executor=ex, chunksize=1)  # the filters as they were again
    ex.shutdown()
print("ok")
"""


def test_the_callers_warnings_filters_reach_the_workers(tmp_path):
    """Filters the caller set (``filterwarnings("ignore", ...)``, ``simplefilter("error")``)
    hold for f's warnings on the workers as in the loop: a FutureWarning ignored is printed by
    no worker, a warning turned into an error raises (NOTE [the caller's warnings filters])."""
    import subprocess

    script = tmp_path / "script.py"
    script.write_text(_WARNINGS_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    assert done.stdout.count("raised gradmap test: shown") == 2, done.stdout
    assert "gradmap test: filtered away" not in done.stderr, done.stderr[-3000:]
    assert "gradmap test: shown" in done.stderr, done.stderr[-3000:]  # (the check can see them)


def test_a_first_map_inside_inference_mode_imports_cleanly(tmp_path):
    """gradmap imports its PyTorch parts at the first map, which may run in inference_mode."""
    import subprocess

    code = (
        "import torch, gradmap\n"
        "with torch.inference_mode():\n"
        "    ys = gradmap.tmap(torch.sin, [torch.randn(3) for _ in range(4)])\n"
        "print(len(ys))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "4", done.stderr[-3000:]


_SETTINGS_MODULE = """
import torch
from torch import nn

SCALE = 1.0
CONF = {"k": 1.0}
MEAN = torch.zeros(3)


def _scaled(x):
    return (x - MEAN) * SCALE * CONF["k"]


def f(x):
    return torch.tanh(_scaled(x)).sum()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(_scaled(x)).sum()
"""

_SETTINGS_SCRIPT = """
import functools, sys
import torch, gradmap
import settings_mod as m
from gradmap import WorkerViewError

xs = [torch.randn(2, 3, requires_grad=True) for _ in range(8)]
net = m.Net()
ex = gradmap.ProcessExecutor(workers=2, caller_helps=False)  # every chunk on a worker
run = functools.partial(gradmap.tmap, executor=ex, chunksize=1)
for fn in (m.f, net, net.forward):
    assert torch.allclose(torch.stack(run(fn, xs)), torch.stack([fn(x) for x in xs]))
    m.SCALE = 3.0  # changed at run time: the workers imported 1.0
    for api in (gradmap.tmap, gradmap.tsum):
        try:
            api(fn, xs, executor=ex, chunksize=1)
        except WorkerViewError as e:
            assert "settings_mod.SCALE is 3.0 in the caller but 1.0" in str(e), e
            assert "closure value" in str(e), e
        else:
            sys.exit(f"no error from {api.__name__} on {fn!r}")
    m.SCALE = 1.0
    m.CONF["k"] = 2.0  # a setting changed in place
    try:
        run(fn, xs)
    except WorkerViewError as e:
        assert "settings_mod.CONF is {'k': 2.0} in the caller" in str(e), e
    else:
        sys.exit(f"no error for CONF on {fn!r}")
    m.CONF["k"] = 1.0
    m.MEAN.add_(0.5)  # a tensor changed in place (NOTE [tensor settings])
    try:
        run(fn, xs)
    except WorkerViewError as e:
        assert "settings_mod.MEAN is tensor(dtype=torch.float32, shape=(3,)" in str(e), e
    else:
        sys.exit(f"no error for MEAN on {fn!r}")
    m.MEAN.zero_()
    assert torch.allclose(torch.stack(run(fn, xs)), torch.stack([fn(x) for x in xs]))
ex.shutdown()
print("ok")
"""


def test_module_settings_changed_at_run_time_are_named(tmp_path):
    """A function of an importable module (and a module's methods) reading a module setting the
    caller changed at run time: the workers imported the module anew, so the map raises, naming
    the setting and the fix, instead of giving other results than the loop (a fresh
    interpreter)."""
    import subprocess

    (tmp_path / "settings_mod.py").write_text(_SETTINGS_MODULE)
    script = tmp_path / "script.py"
    script.write_text(_SETTINGS_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        done.stdout[-2000:] + done.stderr[-3000:]
    )


def test_settings_read_are_listed_cheaply():
    """What the caller lists: plain data read through globals by functions sent by reference
    (not those sent by value, nor the standard library's or torch's)."""
    from gradmap._remote._settings import settings_of

    assert settings_of(lambda x: x * 2) == ()
    assert settings_of(torch.nn.Linear(2, 2)) == ()
    assert settings_of(_on) == ()  # this test module is importable, but reads no plain data


def _forked_processes_map() -> tuple[float, list[int]]:
    executor = gradmap.ProcessExecutor(workers=2)
    w = torch.linspace(-1.0, 1.0, 3, requires_grad=True)
    total = gradmap.tsum(lambda x: (x * w).sin().sum(), torch.ones(8, 3), executor=executor)
    return float(total.detach()), executor.worker_pids()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_workers_of_its_own_and_leaves_the_parents(ex):
    """A forked child neither uses nor stops the parent's worker processes (NOTE [after a
    fork] in ``_executors``): it starts its own; the parent's go on serving the parent."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    mine = _pids(ex)
    w = torch.linspace(-1.0, 1.0, 3, requires_grad=True)
    f = lambda x: (x * w).sin().sum()  # noqa: E731
    want = gradmap.tsum(f, torch.ones(8, 3), executor=ex, chunksize=2)
    with multiprocessing.get_context("fork").Pool(1) as children:
        value, theirs = children.apply_async(_forked_processes_map).get(timeout=120)
    assert value == pytest.approx(float(want.detach()))
    assert not set(theirs) & set(mine)
    assert _pids(ex) == mine
    torch.testing.assert_close(gradmap.tsum(f, torch.ones(8, 3), executor=ex, chunksize=2), want)


@deadline(60)
def test_a_backward_after_another_executor_stopped_the_workers():
    """A map whose backward is still to come, then another executor's block ends, stopping the
    workers they share: the backward starts them again and gives the loop's gradients (a
    stopped worker's calls in flight were left pending, and it was never started again: the
    backward waited ``start_timeout`` and failed); and the next shutdown stops the worker it
    started (its pool, stopped before, was no longer known: the worker ran on)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    xs = [torch.randn(3, 4) for _ in range(12)]
    weights = torch.linspace(0.5, 2.0, len(xs))  # (cotangents other than one: graphs kept)

    def f(x: torch.Tensor) -> torch.Tensor:
        return model(x).pow(2).sum()

    want = torch.autograd.grad((torch.stack(loop(f, xs)) * weights).sum(), model.weight)[0]
    before = set(threading.enumerate())
    with gradmap.ProcessExecutor(1, start_timeout=20) as ex:
        ys = gradmap.tmap(f, xs, executor=ex)
        with gradmap.ProcessExecutor(1) as other:
            gradmap.tsum(lambda x: x.sum(), xs, executor=other)
        got = torch.autograd.grad((torch.stack(ys) * weights).sum(), model.weight)[0]
    close(got, want)
    # the worker the backward started (a writer thread each) stopped with the block
    assert not [t for t in threading.enumerate() if t.name == "gradmap-writer" and t not in before]


def test_a_tensor_f_uses_resized_after_a_map_raises_rather_than_crashing(tmp_path):
    """NOTE [shared storages are not resizable]: a tensor ``f`` reads moves to shared memory in
    place, where PyTorch crashes resizing it (SIGSEGV): after a map, ``resize_`` raises
    PyTorch's error instead. (In a child process: the crash took the whole run down.)"""
    script = tmp_path / "resize.py"
    script.write_text(_RESIZED)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "not resizable" in done.stdout


_RESIZED = """
import torch, gradmap

if __name__ == "__main__":
    cache = torch.zeros(4)
    xs = [torch.randn(4) for _ in range(8)]
    with gradmap.ProcessExecutor(1, caller_helps=False) as ex:
        gradmap.tmap(lambda x: (x * cache).sum(), xs, executor=ex)
    try:
        cache.resize_(8)
    except RuntimeError as e:
        print("raised:", e)
"""


def test_an_error_that_does_not_load_from_its_pickle_keeps_its_class(ex):
    """NOTE [an error that does not load] (``_process/_worker``): a worker's exception whose
    ``__init__`` takes other arguments than it passes on comes back as its own class, with its
    attributes (it came back a ``RuntimeError`` that ``except Diverged`` missed)."""

    def f(i: int) -> torch.Tensor:
        if i == 2:
            raise support.Diverged(7, 0.5)
        return torch.ones(())

    with pytest.raises(support.Diverged, match="diverged at step 7") as caught:
        gradmap.tmap(f, range(4), executor=ex)
    assert caught.value.step == 7
    assert "element 2" in support.notes(caught.value)


@deadline(120)
def test_a_lost_workers_chunks_recomputed_update_running_statistics_once():
    """NOTE [buffers a recompute updates] (``_remote/_map``): a worker killed between a map's
    forward and its backward; its chunks are recomputed by a new one, whose forward must not
    update BatchNorm's running statistics a second time (they were: 48 batches tracked where
    the loop tracks 24). One worker, so that the updates are not racy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(12)]
    weights = torch.linspace(0.5, 2.0, len(xs), dtype=torch.float64)  # (graphs kept)
    mapped = copy.deepcopy(model)
    (torch.stack(loop(lambda x: model(x).pow(2).sum(), xs)) * weights).sum().backward()
    with warnings.catch_warnings(), gradmap.ProcessExecutor(1, caller_helps=False) as ex:
        warnings.simplefilter("ignore")  # (running statistics on worker processes)
        ys = gradmap.tmap(lambda x: mapped(x).pow(2).sum(), xs, executor=ex)
        for pid in ex.worker_pids():
            os.kill(pid, signal.SIGKILL)
        (torch.stack(ys) * weights).sum().backward()
    assert mapped[1].num_batches_tracked == model[1].num_batches_tracked
    close(mapped[1].running_mean, model[1].running_mean)
    for a, b in zip(mapped.parameters(), model.parameters()):
        close(a.grad, b.grad)


_MANY_TENSORS = """
import resource, warnings, torch, gradmap
from torch import nn

if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(150)])  # 300 tensors
    xs = [torch.randn(2) for _ in range(8)]
    f = lambda x: model(x).sum()
    want = torch.autograd.grad(sum(f(x) for x in xs), list(model.parameters()))
    with warnings.catch_warnings(record=True) as told, gradmap.ProcessExecutor(1) as ex:
        warnings.simplefilter("always")
        got = torch.autograd.grad(gradmap.tsum(f, xs, executor=ex), list(model.parameters()))
    assert all(torch.allclose(a, b) for a, b in zip(got, want))
    messages = [str(w.message) for w in told]
    assert any("limit of open files" in m for m in messages), messages
    open(__file__).close()
    print("ok")
"""


def test_more_tensors_than_file_descriptors_leave_the_caller_some(tmp_path):
    """NOTE [file descriptors of shared storages] (``_process/_shared``): a model of more
    tensors than half the limit of open files: the rest travel by value, the map says so once,
    and the caller can still open files (it could not: every descriptor was a storage's)."""
    script = tmp_path / "many.py"
    script.write_text(_MANY_TENSORS)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_a_module_only_the_caller_has_is_named_with_the_fix():
    # A module made at run time (torch_geometric generates a MessagePassing class's propagate()
    # into one for a class of the script): pickled by reference, the worker cannot import it.
    import types

    module = types.ModuleType("gradmap_test_module_made_at_run_time")
    exec("def double(x):\n    return x * 2\n", module.__dict__)
    sys.modules[module.__name__] = module
    w = torch.ones(3, requires_grad=True)
    try:
        with (
            gradmap.ProcessExecutor(workers=1, caller_helps=False, timeout=120) as ex,
            pytest.raises(ModuleNotFoundError) as info,
        ):
            gradmap.tmap(lambda x: module.double(x * w).sum(), [torch.ones(3)] * 4, executor=ex)
    finally:
        del sys.modules[module.__name__]
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "gradmap_test_module_made_at_run_time" in notes and "executor='threads'" in notes, notes
