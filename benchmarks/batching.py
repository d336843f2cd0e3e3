"""When to batch instead of mapping: work that *does* batch, as the loop, as gradmap maps, and as
one batched computation, forward and backward, with the gradients checked against the loop's.

    python benchmarks/batching.py [--reps 5]

- ragged bags: 256 bags of 5-200 rows x 64, an MLP 64-128-128-1, the mean score per bag; batched:
  the rows of all bags concatenated into one matrix, the per-bag mean by ``index_add_``.
- molecules: 192 random molecules of 10-30 atoms, three rounds of message passing (width 32) and a
  sum readout; batched: one disjoint-union graph (atoms concatenated, edges offset), the readout
  per molecule by ``index_add_``.

Variants are interleaved; medians of ``--reps`` runs after one warm-up; ratios to the best loop
(the caller's intra-op threads, or one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradmap


def bags(seed: int) -> tuple[nn.Module, list[Any], Callable[[Any], torch.Tensor], Callable]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)
    )
    items = [
        torch.randn(int(s), 64, generator=g) for s in torch.randint(5, 201, (256,), generator=g)
    ]

    def f(bag: torch.Tensor) -> torch.Tensor:
        return model(bag).mean()

    sizes = torch.tensor([len(b) for b in items])
    segment = torch.repeat_interleave(torch.arange(len(items)), sizes)
    rows = torch.cat(items)

    def batched() -> torch.Tensor:
        scores = model(rows).squeeze(-1)
        sums = torch.zeros(len(items)).index_add_(0, segment, scores)
        return (sums / sizes).sum()

    return model, items, f, batched


class MessagePassing(nn.Module):
    def __init__(self, width: int = 32, rounds: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.message = nn.ModuleList(nn.Linear(width, width) for _ in range(rounds))
        self.update = nn.ModuleList(nn.Linear(width, width) for _ in range(rounds))
        self.readout = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def atoms(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        for message, update in zip(self.message, self.update):
            m = torch.zeros_like(h).index_add_(0, dst, message(h)[src])
            h = torch.relu(update(h) + m)
        return h

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        return self.readout(self.atoms(x, src, dst).sum(0)).squeeze(-1)


def molecules(seed: int) -> tuple[nn.Module, list[Any], Callable[[Any], torch.Tensor], Callable]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = MessagePassing()
    items = []
    for _ in range(192):
        n = int(torch.randint(10, 31, (), generator=g))
        ring = torch.arange(n)
        extra = torch.randint(0, n, (2, n // 3), generator=g)
        a = torch.cat([ring, extra[0]])
        b = torch.cat([(ring + 1) % n, extra[1]])
        src, dst = torch.cat([a, b]), torch.cat([b, a])  # both directions
        items.append((torch.randn(n, 8, generator=g), src, dst, torch.randn((), generator=g)))

    def f(item: Any) -> torch.Tensor:
        x, src, dst, y = item
        return (model(x, src, dst) - y) ** 2

    offsets = torch.tensor([0] + [len(x) for x, *_ in items]).cumsum(0)[:-1]
    xs = torch.cat([x for x, *_ in items])
    src = torch.cat([s + o for (_, s, _, _), o in zip(items, offsets)])
    dst = torch.cat([d + o for (_, _, d, _), o in zip(items, offsets)])
    ys = torch.stack([y for *_, y in items])
    graph = torch.repeat_interleave(
        torch.arange(len(items)), torch.tensor([len(x) for x, *_ in items])
    )

    def batched() -> torch.Tensor:
        h = model.atoms(xs, src, dst)
        pooled = torch.zeros(len(items), h.shape[1]).index_add_(0, graph, h)
        return ((model.readout(pooled).squeeze(-1) - ys) ** 2).sum()

    return model, items, f, batched


def run(name: str, make: Callable, reps: int) -> None:
    model, items, f, batched = make(0)
    params = list(model.parameters())
    threads = torch.get_num_threads()
    variants: dict[str, tuple[Callable[[], torch.Tensor], int]] = {
        "loop (1 thread)": (lambda: torch.stack([f(x) for x in items]).sum(), 1),
        "loop": (lambda: torch.stack([f(x) for x in items]).sum(), threads),
        "tsum": (lambda: gradmap.tsum(f, items), threads),
        "tsum processes": (lambda: gradmap.tsum(f, items, executor="processes"), threads),
        "batched": (batched, threads),
    }
    totals: dict[str, list[float]] = {k: [] for k in variants}
    grads: dict[str, list[torch.Tensor]] = {}
    for rep in range(reps + 1):
        for key, (step, n) in variants.items():
            torch.set_num_threads(n)
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            step().backward()
            t = time.perf_counter() - t0
            torch.set_num_threads(threads)
            grads[key] = [p.grad.clone() for p in params]  # type: ignore[union-attr]
            if rep:
                totals[key].append(t * 1e3)
    medians = {k: statistics.median(v) for k, v in totals.items()}
    best = min(medians["loop"], medians["loop (1 thread)"])
    scale = max(g.abs().max().item() for g in grads["loop"])
    print(
        f"{name}: fwd+bwd ms (median of {reps}), speed-up vs the best loop, max |dgrad| "
        f"(largest gradient entry {scale:.3g})"
    )
    for key, ms in medians.items():
        diff = max((a - b).abs().max().item() for a, b in zip(grads[key], grads["loop"]))
        print(f"  {key:<16}{ms:>9.1f}{best / ms:>8.2f}x  {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(
        f"cores {os.cpu_count()}, torch {torch.__version__}, "
        f"intra-op threads {torch.get_num_threads()}"
    )
    run("ragged bags", bags, args.reps)
    run("molecules", molecules, args.reps)


if __name__ == "__main__":
    main()
