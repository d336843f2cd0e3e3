"""``gradmap demo``: the plain loop, and ``tsum`` and ``tmap`` on threads and on processes, on work
that does not batch, side by side, and which to use here.

A recursive network over random binary trees (the bench's ``tree`` workload): each tree is
embedded bottom-up, leaf rows through a linear layer, each internal node from its two children.
Every tree has its own shape, so its forward is its own Python recursion: there is no batch
dimension to stack trees along and nothing for ``vmap`` to map, and users write the loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import gradmap

from ._executors import available_cores
from .bench.cli import _positive
from .bench.workloads import Tree

__all__ = ["main"]

#: What each variant's line calls, for the verdict.
_CALLS = {
    "loop (1 thread)": "the plain loop, with torch.set_num_threads(1)",
    "loop": "the plain loop",
    "tsum": "gradmap.tsum(tree_loss, trees)",
    "tmap": "gradmap.tmap(tree_loss, trees)",
    "tsum processes": 'gradmap.tsum(tree_loss, trees, executor="processes")',
    "tmap processes": 'gradmap.tmap(tree_loss, trees, executor="processes")',
}


def _timed(
    params: list[torch.Tensor], step: Callable[[], torch.Tensor]
) -> tuple[float, float, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    loss = step()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    return t1 - t0, t2 - t1, grads


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every map's gradients match the loop's."""
    parser = argparse.ArgumentParser(prog="gradmap demo", description=__doc__)
    parser.add_argument(
        "--trees", type=_positive, default=256, help="number of trees (default 256)"
    )
    parser.add_argument("--reps", type=_positive, default=5, help="repetitions, median (default 5)")
    args = parser.parse_args(argv)

    work = Tree.make(seed=0, n=args.trees)
    trees, params = work.items, work.params()
    tree_loss = work.f  # (model(leaves, shape) - y) ** 2, recursing over the tree's shape

    def loop() -> torch.Tensor:
        return torch.stack([tree_loss(t) for t in trees]).sum()

    def summed() -> torch.Tensor:
        return gradmap.tsum(tree_loss, trees)  # type: ignore[no-any-return]

    def mapped() -> torch.Tensor:
        return torch.stack(gradmap.tmap(tree_loss, trees)).sum()

    def summed_processes() -> torch.Tensor:
        return gradmap.tsum(tree_loss, trees, executor="processes")  # type: ignore[no-any-return]

    def mapped_processes() -> torch.Tensor:
        return torch.stack(gradmap.tmap(tree_loss, trees, executor="processes")).sum()

    default_threads = torch.get_num_threads()
    variants = {
        "loop (1 thread)": (loop, 1),
        "loop": (loop, default_threads),
        "tsum": (summed, default_threads),
        "tmap": (mapped, default_threads),
        "tsum processes": (summed_processes, default_threads),
        "tmap processes": (mapped_processes, default_threads),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    grads: dict[str, list[torch.Tensor]] = {}
    try:
        for _ in range(args.reps + 1):  # the first round warms up; rounds interleave variants
            for name, (step, threads) in variants.items():
                torch.set_num_threads(threads)
                fwd, bwd, grads[name] = _timed(params, step)
                times[name].append((fwd, bwd))
    finally:
        torch.set_num_threads(default_threads)

    nodes = [2 * len(t.leaves) - 1 for t in trees]
    print(
        f"gradmap demo: {args.trees} random binary trees ({min(nodes)}-{max(nodes)} nodes), a "
        f"recursive net (hidden {Tree.hidden}) embeds each bottom-up; loss = sum of squared errors"
    )
    print(
        "why a map: every tree has its own shape, so its forward is its own Python recursion: no "
        "batch dimension, nothing for vmap; the plain loop is what users write"
    )
    print(
        f"cores available: {available_cores()}, torch {torch.__version__}, "
        f"intra-op threads (default): {default_threads}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; median of {args.reps} interleaved runs, "
        f"spread = their min-max"
    )
    totals = {name: [(a + b) * 1e3 for a, b in ts[1:]] for name, ts in times.items()}
    medians = {name: statistics.median(t) for name, t in totals.items()}
    best_loop = min(medians["loop (1 thread)"], medians["loop"])
    scale = max(g.abs().max().item() for g in grads["loop"])
    print(
        f"{'variant':<16}{'forward ms':>11}{'backward ms':>12}{'total ms':>10}{'spread ms':>14}"
        f"{'speed-up':>10}{'  max |grad - loop grad|'}"
    )
    worst = 0.0
    for name, ts in times.items():
        fwd = statistics.median(t[0] for t in ts[1:]) * 1e3
        bwd = statistics.median(t[1] for t in ts[1:]) * 1e3
        low, high = min(totals[name]), max(totals[name])
        diff = max((a - b).abs().max().item() for a, b in zip(grads[name], grads["loop"]))
        if not name.startswith("loop"):
            worst = max(worst, diff)
        print(
            f"{name:<16}{fwd:>11.1f}{bwd:>12.1f}{medians[name]:>10.1f}"
            f"{f'{low:.0f}-{high:.0f}':>14}{best_loop / medians[name]:>9.2f}x"
            f"  {diff:.2g}"
        )
    print(f"(largest gradient entry: {scale:.3g}; speed-up: the best loop's total / the variant's)")
    print(_verdict(medians, totals, best_loop))
    return 0 if worst <= 1e-4 * max(1.0, scale) else 1


def _verdict(medians: dict[str, float], totals: dict[str, list[float]], best_loop: float) -> str:
    """The "use here:" line: the fastest call, and a word when the next is within the spread."""
    first, second = sorted(medians, key=medians.__getitem__)[:2]
    line = f"use here: {_CALLS[first]} ({best_loop / medians[first]:.2f}x the best loop)"
    if first.startswith("loop"):
        line += (
            "; no map was faster on these cores: gradmap.compare(f, items) times the loop, "
            "threads and processes on your own f"
        )
    if min(totals[second]) <= max(totals[first]):
        line += (
            f"; {second} ({best_loop / medians[second]:.2f}x) is within the measured spread, so "
            "the two may swap from run to run"
        )
    return line
