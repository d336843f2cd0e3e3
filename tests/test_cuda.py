"""``f`` on CUDA tensors, on threads (NOTE [CUDA streams on the pool's threads] in
``_torch/_cuda``): the loop's values and gradients, a stream per pool thread, pullbacks on the
pool's threads, tsum, remat, errors naming the element, determinism across worker counts, memory;
on processes, the loop's gradients or a clear error.

The tests marked ``CUDA`` need a GPU and skip without one; the first tests run everywhere and
check, with a stand-in for the streams, that every pass of every path goes through them.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import gradmap
from gradmap._torch import _call, _early

from support import notes

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
WORKERS = (1, 2, 4)


# ----------------------------------------------------------------------------------------------
# Everywhere: the wiring, with a stand-in for the streams


class _Recorder:
    """Stands in for ``CudaPass``: counts the chunks and thread contexts it wrapped."""

    passes = 0

    def __init__(self) -> None:
        type(self).passes += 1
        self.chunks = 0
        self.contexts = 0
        self.lock = threading.Lock()

    def chunk(self, run: Any) -> Any:
        def ran(*args: Any) -> Any:
            with self.lock:
                self.chunks += 1
            return run(*args)

        return ran

    def context(self, inner: Any) -> Any:
        def entered(is_caller: bool) -> Any:
            with self.lock:
                self.contexts += 1
            return inner(is_caller)

        return entered


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[_Recorder]:
    made: list[_Recorder] = []

    def streams() -> _Recorder:
        made.append(_Recorder())
        return made[-1]

    monkeypatch.setattr(_call, "pass_streams", streams)
    monkeypatch.setattr(_early, "pass_streams", streams)
    return made


def test_without_cuda_a_pass_has_no_streams():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    from gradmap._torch._cuda import pass_streams

    assert pass_streams() is None  # the CPU path: as before


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_every_pass_runs_its_chunks_through_the_streams(recorded, api):
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(12, 3, dtype=torch.float64)

    def f(x):
        return (x * w).tanh().sum()

    for _ in range(3):  # the first call and placement's turns: one thread, then the pool
        recorded.clear()
        if api == "tmap":
            got = torch.autograd.grad(
                torch.stack(gradmap.tmap(f, xs, workers=2, chunksize=2)).sum(), w
            )
        else:
            got = torch.autograd.grad(gradmap.tsum(f, xs, workers=2, chunksize=2), w)
        (want,) = torch.autograd.grad(torch.stack([f(x) for x in xs]).sum(), w)
        torch.testing.assert_close(got[0], want)
        assert recorded, "no pass asked for streams"
        # every chunk of the map ran through a pass's wrapper: 6 chunks, forward and pullback
        assert sum(r.chunks for r in recorded) >= 6
        assert all(r.contexts >= 1 for r in recorded if r.chunks)


# ----------------------------------------------------------------------------------------------
# On a GPU


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(
        "cuda", torch.float64
    )


def _items(n: int = 24) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(1 + i % 7, 16, generator=gen, dtype=torch.float64).cuda() for i in range(n)]


def _grads(model: torch.nn.Module, total: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(total, list(model.parameters())))


@CUDA
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("remat", [False, True])
def test_tmap_on_cuda_gives_the_loops_values_and_gradients(workers, remat):
    model, xs = _model(), _items()

    def f(x):
        return model(x).pow(2).mean()

    want_values = [f(x) for x in xs]
    want = _grads(model, torch.stack(want_values).sum())
    for _ in range(3):  # placement's turns, with workers forced from the second call
        ys = gradmap.tmap(f, xs, workers=workers, chunksize=3, remat=remat)
        assert all(y.is_cuda for y in ys)
        torch.testing.assert_close(torch.stack(ys), torch.stack(want_values))
        for g, w in zip(_grads(model, torch.stack(ys).sum()), want, strict=True):
            torch.testing.assert_close(g, w)
    # the default placement (no workers): the same
    for _ in range(6):
        ys = gradmap.tmap(f, xs, remat=remat)
        for g, w in zip(_grads(model, torch.stack(ys).sum()), want, strict=True):
            torch.testing.assert_close(g, w)


@CUDA
@pytest.mark.parametrize("workers", WORKERS)
def test_tsum_on_cuda_gives_the_loops_sum_and_gradients(workers):
    model, xs = _model(), _items()

    def f(x):
        return model(x).pow(2).mean()

    loss = torch.stack([f(x) for x in xs]).sum()
    want = _grads(model, loss)
    for _ in range(3):
        total = gradmap.tsum(f, xs, workers=workers, chunksize=3)
        assert total.is_cuda
        torch.testing.assert_close(total, loss.detach())
        for g, w in zip(_grads(model, total), want, strict=True):
            torch.testing.assert_close(g, w)


@CUDA
def test_gradients_on_cuda_are_bitwise_the_same_for_every_worker_count():
    model, xs = _model(), _items(40)

    def f(x):
        return model(x).pow(2).mean()

    first: list[torch.Tensor] | None = None
    for workers in (1, 2, 3, 4, 1):
        for _ in range(2):
            grads = _grads(model, gradmap.tsum(f, xs, workers=workers, chunksize=4))
            if first is None:
                first = grads
            for g, w in zip(grads, first, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)


@CUDA
def test_each_pool_thread_runs_its_chunks_on_a_stream_of_its_own_and_pulls_back_there():
    model, xs = _model(), _items(32)
    seen: dict[int, set[int]] = {}
    pulled: set[int] = set()
    lock = threading.Lock()
    caller = threading.get_ident()

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            with lock:
                seen.setdefault(threading.get_ident(), set()).add(
                    torch.cuda.current_stream().stream_id
                )
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            with lock:
                pulled.add(threading.get_ident())
            return g

    def f(x):
        return model(Mark.apply(x)).pow(2).mean()

    want = _grads(model, torch.stack([f(x) for x in xs]).sum())
    seen.clear()
    pulled.clear()
    for _ in range(2):
        ys = gradmap.tmap(f, xs, workers=4, chunksize=2)
        got = _grads(model, torch.stack(ys).sum())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    helpers = {t: s for t, s in seen.items() if t != caller}
    assert helpers, "no chunk ran on a pool thread"
    default = torch.cuda.default_stream().stream_id
    streams = [next(iter(s)) for s in helpers.values()]
    assert all(len(s) == 1 for s in helpers.values())  # one stream per thread
    assert default not in streams and len(set(streams)) == len(streams)  # each its own
    # pullbacks on gradmap's threads, not only on PyTorch's device thread
    assert pulled & set(helpers), (pulled, set(helpers))


@CUDA
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_an_error_on_cuda_names_the_element(api):
    model, xs = _model(), _items(20)

    class Boom(Exception):
        pass

    def f(x):
        if x.shape[0] == 6:  # elements 5 and 12 (sizes 1 + i % 7)
            raise Boom("bad element")
        return model(x).pow(2).mean()

    with pytest.raises(Boom) as info:
        for _ in range(3):
            if api == "tmap":
                gradmap.tmap(f, xs, workers=4, chunksize=2)
            else:
                gradmap.tsum(f, xs, workers=4, chunksize=2)
    assert "element 5 (of 20)" in notes(info.value)


@CUDA
def test_memory_on_cuda_is_the_loops_plus_a_chunk_per_worker():
    model, xs = _model(), _items(64)
    workers, chunksize = 4, 4

    def f(x):
        return model(x.repeat(64, 1)).pow(2).mean()

    def peak(run: Any) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    loop = peak(lambda: _grads(model, torch.stack([f(x) for x in xs]).sum()))
    chunk = peak(lambda: _grads(model, torch.stack([f(x) for x in xs[:chunksize]]).sum()))
    for _ in range(2):
        mapped = peak(lambda: _grads(model, gradmap.tsum(f, xs, workers=workers, chunksize=4)))
    assert mapped <= loop + workers * chunk, (mapped, loop, chunk)


@CUDA
@pytest.mark.parametrize("executor", ["processes", "ray"])
def test_cuda_tensors_on_worker_processes_give_the_loops_gradients_or_a_clear_error(executor):
    if executor == "ray":
        pytest.importorskip("ray")
    model, xs = _model(), _items(8)

    def f(x):
        return model(x).pow(2).mean()

    want = _grads(model, torch.stack([f(x) for x in xs]).sum())
    try:
        total = gradmap.tsum(f, xs, executor=executor, workers=2, chunksize=2)
    except Exception as exc:  # a clear error: it names CUDA or the device
        message = str(exc) + notes(exc)
        assert "cuda" in message.lower() or "device" in message.lower(), message
        return
    for g, w in zip(_grads(model, total), want, strict=True):
        torch.testing.assert_close(g.to(w.device), w)
