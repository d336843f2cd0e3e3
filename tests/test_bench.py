"""Tests of ``gradmap bench``: the command runs, and every workload's gradients match the loop.

No timing is asserted: only that the bench ran, reported, and found the gradients equal.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

import gradmap
from gradmap.bench.cli import main
from gradmap.bench.runner import grad_difference
from gradmap.bench.variants import VARIANT_NAMES, build_variants, loop_loss
from gradmap.bench.workloads import (
    WORKLOADS,
    NeuralODE,
    RaggedBags,
    SmallBags,
    Tree,
    TreeShape,
    Workload,
)

SMALL_N = 6


def _grads(workload: Workload[Any], total: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of ``total`` with respect to the workload's parameters (zeros where unused)."""
    params = workload.params()
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _assert_grads_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Gradients equal up to float32 rounding, measured against each tensor's largest entry."""
    for got, want in zip(actual, expected, strict=True):
        scale = float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale + 1e-7)


def _count_nodes(shape: TreeShape) -> int:
    """Number of nodes of a tree shape."""
    if isinstance(shape, int):
        return 1
    return 1 + _count_nodes(shape[0]) + _count_nodes(shape[1])


# ----------------------------------------------------------------------------------------------
# The command


def test_quick_run_reports_every_variant_and_matching_gradients(tmp_path, capsys):
    path = tmp_path / "bench.json"
    status = main(
        ["--quick", "--workloads", "small_bags", "-n", "16", "--reps", "1", "--json", str(path)]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "small_bags" in captured.out
    for name in VARIANT_NAMES:
        assert f" {name}" in captured.out
    assert "small_bags (N=16)" in captured.err  # progress
    assert "gradmap's own cost, serial forward / loop1 forward: small_bags " in captured.out
    record = json.loads(path.read_text())
    assert record["config"]["quick"] is True
    assert record["environment"]["torch"] == torch.__version__
    (workload,) = record["workloads"]
    assert workload["n"] == 16
    assert workload["baseline"] in ("loop1", "loop")
    assert set(workload["variants"]) == set(VARIANT_NAMES)
    for variant in workload["variants"].values():
        assert variant["grad_ok"], variant
        assert len(variant["fwd_s"]) == len(variant["bwd_s"]) == 1


def test_vmap_is_left_out_where_the_workload_has_no_batched_form(capsys):
    status = main(
        [
            "--workloads",
            "overhead",
            "-n",
            "8",
            "--reps",
            "1",
            "--warmup",
            "0",
            "-q",
            "--variants",
            "loop,vmap",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert " loop*" in out
    assert " vmap" not in out


def test_a_gradient_beyond_tolerance_makes_the_exit_status_nonzero(capsys, monkeypatch):
    import gradmap.bench.runner as runner

    monkeypatch.setattr(runner, "grad_difference", lambda got, want: (1.0, 1.0))
    status = main(
        ["--workloads", "tree", "-n", "2", "--reps", "1", "-q", "--variants", "loop", "--tol", "0"]
    )
    assert status == 1
    assert "gradient mismatch: tree/loop" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    status = main(["--quick", "--plot", "speedup.png"])
    assert status == 2
    assert "pip install 'gradmap[plot]'" in capsys.readouterr().err


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedup.png"
    status = main(
        [
            "--workloads",
            "tree",
            "-n",
            "4",
            "--reps",
            "1",
            "--warmup",
            "0",
            "-q",
            "--variants",
            "loop,tmap",
            "--plot",
            str(path),
        ]
    )
    assert status == 0
    assert path.stat().st_size > 0


def test_sweep_times_the_worker_counts_given(capsys):
    args = "--workloads tree -n 4 --reps 1 --warmup 0 -q --variants loop --sweep 2,1,2"
    status = main(args.split())
    assert status == 0
    out = capsys.readouterr().out
    for name in ("tmap:1", "tmap:2", "tmap-proc:1", "tmap-proc:2"):
        assert name in out
    assert "tmap:3" not in out
    with pytest.raises(SystemExit):
        main(["--sweep", "0"])


def test_list_and_unknown_names(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in WORKLOADS:
        assert name in out
    with pytest.raises(SystemExit) as excinfo:
        main(["--workloads", "nope"])
    assert excinfo.value.code == 2
    with pytest.raises(SystemExit):
        main(["--variants", "tmap"])  # no baseline loop


@pytest.mark.parametrize(
    "args",
    [
        ["--executor", "bogus"],
        ["--tol", "-1"],
        ["--tol", "nan"],
        ["--reps", "0"],
    ],
)
def test_bad_options_are_usage_errors(args, capsys):
    """Options out of range stop at the parser, with its usage line, not a traceback later."""
    with pytest.raises(SystemExit) as excinfo:
        main(args)
    assert excinfo.value.code == 2
    assert "usage: gradmap bench" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["demo", "--trees", "0"], ["demo", "--reps", "0"], ["build", "-x"]]
)
def test_gradmap_command_usage_errors(args, capsys):
    from gradmap._cli import main as gradmap_main

    try:
        status = gradmap_main(args)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    assert "usage: gradmap" in capsys.readouterr().err


def test_gradmap_build_help_builds_nothing(capsys, monkeypatch):
    from gradmap._cli import main as gradmap_main
    from gradmap._torch import _native

    monkeypatch.setattr(_native, "build", lambda: pytest.fail("gradmap build --help built"))
    assert gradmap_main(["build", "--help"]) == 0
    assert "usage: gradmap build" in capsys.readouterr().out


def test_grad_difference():
    a = [torch.tensor([1.0, -2.0]), None]
    assert grad_difference(a, [torch.tensor([1.0, -2.0]), None]) == (0.0, 0.0)
    diff_abs, diff_rel = grad_difference(a, [torch.tensor([1.0, -1.0]), None])
    assert diff_abs == pytest.approx(1.0)
    assert diff_rel == pytest.approx(0.5)
    assert grad_difference(a, [None, None]) == (float("inf"), float("inf"))


# ----------------------------------------------------------------------------------------------
# The workloads


@pytest.mark.parametrize("executor", [None, "serial"])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_tmap_gradients_equal_the_loop(name, executor):
    workload = WORKLOADS[name].make(0, SMALL_N)
    expected = _grads(workload, loop_loss(workload))
    losses = gradmap.tmap(workload.f, workload.items, executor=executor)
    assert len(losses) == SMALL_N
    actual = _grads(workload, torch.stack(losses).sum())
    _assert_grads_close(actual, expected)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_tmap_with_two_workers_and_chunks_of_one_equals_the_loop(name):
    workload = WORKLOADS[name].make(1, SMALL_N)
    expected = _grads(workload, loop_loss(workload))
    losses = gradmap.tmap(workload.f, workload.items, workers=2, chunksize=1)
    actual = _grads(workload, torch.stack(losses).sum())
    _assert_grads_close(actual, expected)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_raw_threads_reference_equals_the_loop(name):
    """The ``raw`` row (a chunked loop on plain threads, no gradmap) gives the loop's loss and
    gradients, so the table compares like with like."""
    (raw,) = build_variants(["raw"], workers=2)
    workload = WORKLOADS[name].make(2, SMALL_N)
    expected_loss = loop_loss(workload)
    expected = _grads(workload, expected_loss)
    with raw.settings():
        loss = raw.total_loss(workload)
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads_close(_grads(workload, loss), expected)


@pytest.mark.parametrize("cls", [RaggedBags, SmallBags])
def test_batched_loss_equals_the_loop(cls):
    workload = cls.make(0, SMALL_N)
    expected_loss = loop_loss(workload)
    expected = _grads(workload, expected_loss)
    batched = workload.batched_loss(workload.items)
    torch.testing.assert_close(batched, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    _assert_grads_close(_grads(workload, batched), expected)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_make_is_deterministic_and_leaves_the_global_rng_alone(name):
    cls = WORKLOADS[name]
    state = torch.random.get_rng_state()
    a, b, c = cls.make(3, SMALL_N), cls.make(3, SMALL_N), cls.make(4, SMALL_N)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert len(a.items) == SMALL_N
    assert cls.quick_n < cls.default_n
    for pa, pb in zip(a.params(), b.params(), strict=True):
        assert torch.equal(pa, pb)
    assert torch.equal(loop_loss(a), loop_loss(b))
    assert not torch.equal(loop_loss(a), loop_loss(c))
    for item in a.items:
        assert a.f(item).shape == ()


def test_workload_shapes_follow_their_description():
    ragged = RaggedBags.make(0, 64)
    assert all(5 <= len(bag.x) <= 200 and bag.x.shape[1] == 64 for bag in ragged.items)
    small = SmallBags.make(0, 64)
    assert all(1 <= len(bag.x) <= 8 and bag.x.shape[1] == 16 for bag in small.items)
    tree = Tree.make(0, 64)
    for sample in tree.items:
        assert 5 <= _count_nodes(sample.shape) <= 60
        assert _count_nodes(sample.shape) == 2 * len(sample.leaves) - 1
    ode = NeuralODE.make(0, 64)
    assert all(10 <= sample.steps <= 60 for sample in ode.items)


def test_demo_runs_every_variant_and_says_which_to_use(capsys):
    # The README's first command: the loop, and tsum and tmap on threads and on processes, with
    # gradients that match the loop's (the exit status says so) and a line naming what to use.
    from gradmap._demo import main as demo

    assert demo(["--trees", "12", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip() for line in out.splitlines()}
    for name in ("loop (1 thread)", "loop", "tsum", "tmap", "tsum processes", "tmap processes"):
        assert name in rows, out
    assert "why a map:" in out
    use = [line for line in out.splitlines() if line.startswith("use here: ")]
    assert len(use) == 1 and ("gradmap.t" in use[0] or "the plain loop" in use[0]), out


def test_demo_verdict_names_the_fastest_call_and_close_calls():
    from gradmap._demo import _verdict

    totals = {"loop (1 thread)": [10.0, 11, 12], "loop": [20.0, 21, 22], "tsum": [7.0, 8, 9]}
    medians = {k: v[1] for k, v in totals.items()}
    line = _verdict(medians, totals, best_loop=11.0)
    assert line.startswith("use here: gradmap.tsum(tree_loss, trees) (1.38x the best loop)")
    assert "spread" not in line
    totals["tsum"] = [12.0, 13, 14]  # the 1-thread loop wins, tsum within its spread
    medians = {k: v[1] for k, v in totals.items()}
    line = _verdict(medians, totals, best_loop=11.0)
    assert line.startswith("use here: the plain loop, with torch.set_num_threads(1)")
    assert "tsum (0.85x) is within the measured spread" in line
