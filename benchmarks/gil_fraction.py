"""How much of a workload's forward holds the GIL: the ceiling on what threads can give it.

For each workload, times the per-element forward (no gradmap, grad mode on, one intra-op thread)
on one thread, T1, and split in two halves on two raw threads, T2, interleaved over repetitions.
If a fraction g of the work holds the GIL and the rest runs in parallel, T2 = T1 * (g + (1-g)/2),
so g = 2 * T2 / T1 - 1 (clamped to [0, 1]). The same for the backward of each half (PyTorch's
engine releases the GIL while it runs nodes). Run: python benchmarks/gil_fraction.py [--reps K].
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time

import torch

from gradmap.bench.workloads import WORKLOADS


def _forward(w, items):
    return [w.f(x) for x in items]


def _two_threads(fn, halves):
    out = [None, None]

    def run(k):
        torch.set_num_threads(1)
        out[k] = fn(halves[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--workloads", default="ragged_bags,small_bags,tree,ode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"cores 2 assumed; torch {torch.__version__}; intra-op threads 1; medians of {args.reps}")
    print(
        f"{'workload':<12}{'fwd 1 thr ms':>14}{'fwd 2 thr ms':>14}{'GIL-held':>10}"
        f"{'bwd 1 thr ms':>14}{'bwd 2 thr ms':>14}{'GIL-held':>10}"
    )
    for name in args.workloads.split(","):
        w = WORKLOADS[name].make(0, WORKLOADS[name].default_n)
        items = list(w.items)
        halves = [items[0::2], items[1::2]]
        gc.collect()
        gc.freeze()
        f1, f2, b1, b2 = [], [], [], []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            losses = _forward(w, items)
            f1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.stack(losses).sum().backward()
            b1.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            parts = _two_threads(lambda h, w=w: _forward(w, h), halves)
            f2.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _two_threads(lambda p: torch.stack(p).sum().backward(), parts)
            b2.append(time.perf_counter() - t0)
        gc.unfreeze()
        m = [statistics.median(v) * 1e3 for v in (f1, f2, b1, b2)]
        g_f = min(1.0, max(0.0, 2 * m[1] / m[0] - 1))
        g_b = min(1.0, max(0.0, 2 * m[3] / m[2] - 1))
        print(
            f"{name:<12}{m[0]:>14.1f}{m[1]:>14.1f}{g_f:>10.2f}{m[2]:>14.1f}{m[3]:>14.1f}{g_b:>10.2f}"
        )


if __name__ == "__main__":
    main()
