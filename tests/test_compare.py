"""``gradmap.compare``: the loop, threads and processes timed on the user's own ``f``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradmap


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    bags = [torch.randn(n, 4) for n in (3, 1, 5, 2, 4, 6)]
    return model, bags, (lambda bag: model(bag).mean())


@pytest.mark.parametrize("tsum", [False, True])
def test_compare_times_every_candidate_and_restores_grads(tsum):
    model, bags, f = _setup()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # a gradient the comparison must leave as it was
    report = gradmap.compare(f, bags, executors=("threads", "serial"), tsum=tsum, reps=2)
    label = "tsum" if tsum else "tmap"
    names = {row.name for row in report.rows}
    assert {"loop", f"{label}(executor='threads')", f"{label}(executor='serial')"} <= names
    assert report.rows[0].name.startswith("loop")  # the faster loop is the baseline
    for row in report.rows:
        assert row.error is None and row.forward > 0 and row.backward > 0
        if not row.name.startswith("loop"):
            assert row.grad_error is not None and row.grad_error < 1e-5
    assert report.best in names
    assert report.speedup(report.rows[0].name) == pytest.approx(1.0)
    text = str(report)
    assert "use:" in text and label in text
    for p in model.parameters():
        assert torch.equal(p.grad, torch.full_like(p, 7.0))


def test_compare_times_maps_once_settled():
    """A map's first calls measure where its forward runs (NOTE [forward placement]): compare
    runs them untimed, then times as many runs of each map as of each loop."""
    from gradmap._compare import SETTLE

    _, bags, f = _setup()
    calls = [0]

    def counted(bag):
        calls[0] += 1
        return f(bag)

    reps = 2
    gradmap.compare(counted, bags, executors=("serial",), reps=reps)
    loops = 2 if torch.get_num_threads() > 1 else 1
    assert SETTLE >= 4
    assert calls[0] == (loops * (1 + reps) + 1 + SETTLE + reps) * len(bags)


def test_compare_reports_a_failing_candidate_and_wrong_gradients(monkeypatch):
    _, bags, f = _setup()
    report = gradmap.compare(f, bags, executors=("no-such-executor",), reps=1)
    (failed,) = [row for row in report.rows if row.error is not None]
    assert "no-such-executor" in failed.name and "ValueError" in failed.error
    assert report.best.startswith("loop")
    assert "failed" in str(report)

    # A candidate whose gradients differ from the loop's is never recommended.
    import gradmap._compare as compare_module

    real = compare_module._difference
    monkeypatch.setattr(compare_module, "_difference", lambda got, want, torch: (0.0, 1.0))
    report = gradmap.compare(f, bags, executors=("threads",), reps=1)
    assert report.best.startswith("loop")
    (note,) = [note for note in report.notes if "differs from the loop" in note]
    assert "gradients 1.0e+00" in note and "not safe on threads" in note
    assert "Not recommended" in note and "differs" in str(report)
    monkeypatch.setattr(compare_module, "_difference", real)


def test_compare_takes_one_executor_name_and_leaves_the_generator_as_it_was():
    _, bags, f = _setup()
    torch.manual_seed(3)
    state = torch.get_rng_state()
    report = gradmap.compare(f, bags, executors="serial", reps=1)  # a name, not its letters
    assert [row.name for row in report.rows if not row.name.startswith("loop")] == [
        "tmap(executor='serial')"
    ]
    assert all(row.error is None for row in report.rows)
    assert torch.equal(torch.get_rng_state(), state)


def test_compare_does_not_call_other_random_draws_wrong_gradients():
    """Dropout in f: a map draws per element, the loop from one stream; their gradients differ
    by design, which the report says, rather than calling them wrong."""
    model, bags, _ = _setup()
    drop = torch.nn.Dropout(0.5)

    def f(bag):
        return drop(model(bag)).mean()

    report = gradmap.compare(f, bags, executors=("serial",), reps=1)
    assert not any("differ" in note for note in report.notes)
    assert any("random numbers" in note for note in report.notes)
    assert all(row.grad_error is None for row in report.rows)


def test_compare_bad_input():
    _, bags, f = _setup()
    with pytest.raises(ValueError, match="no elements"):
        gradmap.compare(f, [])
    with pytest.raises(ValueError, match="reps"):
        gradmap.compare(f, bags, reps=0)
    with pytest.raises(ValueError, match="no floating-point tensor that requires grad"):
        gradmap.compare(lambda bag: bag.sum(), bags, executors=())
