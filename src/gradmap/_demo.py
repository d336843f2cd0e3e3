"""``gradmap demo``: the plain loop, and ``tsum`` and ``tmap`` on threads and on processes, on
ragged bags, side by side, and which to use here.

A multiple-instance model: each bag is a different number of feature rows; an MLP scores every row
and the bag's loss is the mean score. Bags do not batch without padding, so users write a loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import gradmap

from ._executors import available_cores

__all__ = ["main"]


def _make(n_bags: int, seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)
    )
    sizes = torch.randint(5, 201, (n_bags,), generator=g).tolist()
    bags = [torch.randn(s, 64, generator=g) for s in sizes]
    return model, bags


def _timed(model: nn.Module, step: object) -> tuple[float, float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss = step()  # type: ignore[operator]
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    return t1 - t0, t2 - t1, grads


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when tmap's gradients match the loop's."""
    parser = argparse.ArgumentParser(prog="gradmap demo", description=__doc__)
    parser.add_argument("--bags", type=int, default=256, help="number of bags (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions, median (default 5)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, bags = _make(args.bags, seed=0)

    def f(bag: torch.Tensor) -> torch.Tensor:
        return model(bag).mean()

    def loop() -> torch.Tensor:
        return torch.stack([f(bag) for bag in bags]).sum()

    def summed() -> torch.Tensor:
        return gradmap.tsum(f, bags)  # type: ignore[no-any-return]

    def mapped() -> torch.Tensor:
        return torch.stack(gradmap.tmap(f, bags)).sum()

    def summed_processes() -> torch.Tensor:
        return gradmap.tsum(f, bags, executor="processes")  # type: ignore[no-any-return]

    def mapped_processes() -> torch.Tensor:
        return torch.stack(gradmap.tmap(f, bags, executor="processes")).sum()

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
    for _ in range(args.reps + 1):  # the first round warms up
        for name, (step, threads) in variants.items():
            torch.set_num_threads(threads)
            fwd, bwd, grads[name] = _timed(model, step)
            times[name].append((fwd, bwd))
    torch.set_num_threads(default_threads)

    print(
        f"gradmap demo: {args.bags} ragged bags (5-200 rows x 64), MLP 64-128-128-1, "
        f"loss = sum of per-bag means"
    )
    print(
        f"cores available: {available_cores()}, torch {torch.__version__}, "
        f"intra-op threads (default): {default_threads}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, median of {args.reps}"
    )
    medians = {}
    for name, ts in times.items():
        fwd = statistics.median(t[0] for t in ts[1:]) * 1e3
        bwd = statistics.median(t[1] for t in ts[1:]) * 1e3
        medians[name] = (fwd, bwd)
    best_loop = min(sum(medians["loop (1 thread)"]), sum(medians["loop"]))
    print(f"{'variant':<17}{'forward ms':>12}{'backward ms':>13}{'total ms':>10}{'speed-up':>10}")
    for name, (fwd, bwd) in medians.items():
        print(
            f"{name:<17}{fwd:>12.1f}{bwd:>13.1f}{fwd + bwd:>10.1f}{best_loop / (fwd + bwd):>9.2f}x"
        )
    scale = max(b.abs().max().item() for b in grads["loop"])
    worst = 0.0
    maps = [name for name in variants if not name.startswith("loop")]
    for name in maps:
        diff = max((a - b).abs().max().item() for a, b in zip(grads[name], grads["loop"]))
        worst = max(worst, diff)
        print(f"max |grad({name}) - grad(loop)| = {diff:.3g} (largest gradient entry {scale:.3g})")
    best = min(maps, key=lambda name: sum(medians[name]))
    if sum(medians[best]) < best_loop:
        api, _, executor = best.partition(" ")
        where = ', executor="processes"' if executor else ""
        speed = best_loop / sum(medians[best])
        print(f"use here: gradmap.{api}(bag_loss, bags{where}) ({speed:.2f}x the loop)")
    else:
        print("use here: the plain loop (no map was faster on these cores);")
        print("  gradmap.compare(f, items) times the loop, threads and processes on your own f")
    return 0 if worst <= 1e-4 * max(1.0, scale) else 1
