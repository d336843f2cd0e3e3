"""tmap and tsum on threads with CUDA tensors against the plain loop on the same GPU.

Per-element trees and per-sample neural ODEs of ``gradmap bench`` (seed 0), model and items
moved to ``--device``; for each workload the variants run interleaved over ``--reps``
repetitions after one warm-up each (the warm-up also lets placement measure), medians of
forward + backward shown, with the largest gradient difference to the loop's. Every pass ends
with ``torch.cuda.synchronize()`` before its clock is read.

Run: ``python benchmarks/gpu_bench.py [--device cuda] [--reps 5] [--workers 1,2,4,8]`` (on the
lent GPU machine: ``bash benchmarks/gpu.sh``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

import gradmap
from gradmap.bench.workloads import WORKLOADS


def _to(obj: Any, device: str) -> Any:
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, obj)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def variants(workers: list[int]) -> dict[str, Callable[[Any, list[Any]], torch.Tensor]]:
    out: dict[str, Callable[[Any, list[Any]], torch.Tensor]] = {
        "loop": lambda f, xs: torch.stack([f(x) for x in xs]).sum(),
        "tmap": lambda f, xs: torch.stack(gradmap.tmap(f, xs)).sum(),
        "tsum": lambda f, xs: gradmap.tsum(f, xs),
    }
    for w in workers:
        out[f"tmap:{w}"] = lambda f, xs, w=w: torch.stack(gradmap.tmap(f, xs, workers=w)).sum()
        out[f"tsum:{w}"] = lambda f, xs, w=w: gradmap.tsum(f, xs, workers=w)
    return out


def run(name: str, n: int | None, device: str, reps: int, workers: list[int]) -> list[str]:
    workload = WORKLOADS[name].make(0, n or WORKLOADS[name].default_n)
    workload.model.to(device)  # type: ignore[attr-defined]
    items = [_to(x, device) for x in workload.items]  # type: ignore[attr-defined]
    params = workload.params()
    table = variants(workers)
    times: dict[str, list[float]] = {k: [] for k in table}
    grads: dict[str, list[torch.Tensor]] = {}
    for rep in range(reps + 1):  # the first round warms up
        names = list(table)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for key in names:
            _sync(device)
            start = time.perf_counter()
            got = torch.autograd.grad(table[key](workload.f, items), params, allow_unused=True)
            _sync(device)
            if rep:
                times[key].append(time.perf_counter() - start)
            else:
                grads[key] = [torch.zeros_like(p) if g is None else g for p, g in zip(params, got)]
    loop = statistics.median(times["loop"])
    lines = [f"{name} N={len(items)} on {device}: median of {reps}, ms; speed-up over the loop"]
    for key, ts in times.items():
        diff = max(float((g - w).abs().max()) for g, w in zip(grads[key], grads["loop"]))
        ms = statistics.median(ts) * 1e3
        lines.append(f"  {key:<8} {ms:9.2f} ms {loop * 1e3 / ms:6.2f}x  max|dgrad| {diff:.1e}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--workloads", default="tree,ode")
    parser.add_argument("-n", type=int, default=None, help="elements (default: the bench's)")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",") if w]
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(), flush=True)
    for name in args.workloads.split(","):
        print("\n".join(run(name, args.n, args.device, args.reps, workers)), flush=True)


if __name__ == "__main__":
    main()
