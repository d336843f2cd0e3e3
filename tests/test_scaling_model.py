"""Invariants of the scaling model (``benchmarks/scaling_model.py``): no timing, only the
simulation of gradmap's schedule on made-up costs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def _model() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "scaling_model.py"
    spec = importlib.util.spec_from_file_location("scaling_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_model"] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


model = _model()
FREE = model.Machine(call=0.0, message=0.0, answer=0.0)  # no latency, work as the loop's


@pytest.mark.parametrize("api", ["tmap", "tsum"])
@pytest.mark.parametrize("caller_helps", [True, False])
def test_equal_elements_without_latency_scale_as_the_chunks_divide(api, caller_helps):
    costs = [1e-3] * 256  # 64 chunks of 4
    m = model.Machine(call=0.0, message=0.0, answer=0.0, caller_helps=caller_helps)
    for w in (1, 4, 8, 16, 32, 64):
        assert model.speedup(costs, costs, w, m, api) == pytest.approx(w)
    # two workers: the calls in flight commit a chunk too many to one of them (33 and 31)
    assert model.speedup(costs, costs, 2, m, api) == pytest.approx(64 / 33)


def test_speedup_is_at_most_the_workers_and_monotone_for_equal_elements():
    costs = [1e-3] * 640
    for m, counts in ((FREE, range(1, 65)), (model.Machine(), (1, 2, 4, 8, 16, 32, 64))):
        previous = 0.0
        for w in counts:
            s = model.speedup(costs, costs, w, m)
            assert s <= w + 1e-9
            assert s >= previous - 1e-9, (w, s, previous)
            previous = s


def test_ragged_elements_lose_to_the_tail_and_a_serial_part_bounds_the_speedup():
    ragged = [1e-3 * (1 + (i * 7919) % 50) for i in range(128)]
    s16 = model.speedup(ragged, ragged, 16, FREE)
    assert 8 < s16 < 16  # 64 chunks of unequal cost over 16 workers: an uneven end
    loop = 2 * sum(ragged)
    serial = model.Machine(call=0.0, message=0.0, answer=0.0, serial=loop / 10)
    assert model.speedup(ragged, ragged, 64, serial) < 10  # Amdahl: at most 1 / 0.1


def test_the_caller_takes_chunks_from_the_end_one_at_a_time():
    costs = [1.0] * 64
    end, ran = model.simulate_pass(costs, 4, FREE)
    assert end == pytest.approx(16.0)
    caller = [c for c, a in enumerate(ran) if a == 3]
    assert caller and caller == list(range(64 - len(caller), 64))  # a run at the end
    # backward: every chunk on the worker that ran its forward
    _, again = model.simulate_pass(costs, 4, FREE, owners=ran)
    assert again == ran


def test_latency_and_a_slower_worker_cost_time():
    costs = [1e-4] * 64
    slow = model.Machine(message=1e-3)
    assert model.simulate_map(costs, costs, 8, slow) > model.simulate_map(costs, costs, 8, FREE)
    start = model.Machine(call=0.0, message=0.0, answer=0.0, start=1.0, caller_helps=False)
    assert model.simulate_map(costs, costs, 4, start) >= 1.0
