"""The Ray executor: the loop's gradients from actors in other processes, lost workers included.

What every remote executor must do (the process executor's too) is tested in ``test_remote.py``;
here, what is Ray's own. One local Ray instance (2 CPUs, so 2 actors) serves the whole module.
"""

from __future__ import annotations

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
from support import Killer, Setup, SlowBackward, loop, mark  # noqa: E402


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
    support.collect()
    assert ex.stored_calls() == [0] * len(ex.actors())


def test_local_instance_listens_on_loopback(ex):
    assert len(ex.actors()) == 2
    if ray.util.get_node_ip_address() != "127.0.0.1":
        pytest.skip("Ray was connected before this module (not gradmap's local instance)")
    assert ex.worker_pids() and os.getpid() not in ex.worker_pids()


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
