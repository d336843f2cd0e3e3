"""Where a map on worker processes spends its time: against the plain loop, the serial executor,
and one worker process doing every chunk; then what the caller itself does in a call.

For one of the bench's workloads (``ragged_bags`` by default), in one process, the variants run
interleaved over ``--reps`` repetitions after warm-ups, medians of forward and backward shown:

- ``loop1``: the plain loop with one intra-op thread (what one worker's chunks compete with);
- ``serial``: ``tmap(executor="serial")``, the loop plus gradmap's own work;
- ``worker``: ``tmap`` on ``ProcessExecutor(1, caller_helps=False)``: every chunk on one worker
  process while the caller only sends and receives, so against ``serial`` it is what a chunk
  costs on a worker (its items and results, the transport, the host's bookkeeping);
- ``tmap-proc`` / ``tsum-proc``: the default ``ProcessExecutor`` (on 2 cores, one worker
  process and the caller).

Then, for ``tmap-proc`` and ``tsum-proc``, the caller's own time per call, read by wrapping
gradmap's internal functions (so this script follows them as they change): pickling ``f``,
checking the kept items of every chunk, reading the workers' answers, its own chunks (how many
of the map's, and their seconds), and waiting for a worker. The speed-ups that matter are in
``gradmap bench``; this says where the difference to two plain processes goes (docs/performance.md).

Run: ``python benchmarks/processes_costs.py [--workload NAME] [--reps K]``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

import gradmap
from gradmap._process import _transport
from gradmap._remote import _map
from gradmap.bench.workloads import WORKLOADS

Timings = dict[str, list[float]]


@contextmanager
def _counted(
    owner: Any, name: str, into: Timings, label: Callable[..., str | None]
) -> Iterator[None]:
    """While inside, each call of ``owner.name`` adds its seconds to ``into[label(*args)]``."""
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            key = label(*args, **kwargs)
            if key is not None:
                into[key].append(time.perf_counter() - start)

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="ragged_bags", choices=sorted(WORKLOADS))
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()

    w = WORKLOADS[args.workload].make(0, WORKLOADS[args.workload].default_n)
    f, items, params = w.f, w.items, w.params()
    alone = gradmap.ProcessExecutor(1, caller_helps=False)
    shared = gradmap.ProcessExecutor()

    def loop1() -> torch.Tensor:
        return torch.stack([f(x) for x in items]).sum()

    def mapped(executor: Any) -> Callable[[], torch.Tensor]:
        return lambda: torch.stack(gradmap.tmap(f, items, executor=executor)).sum()

    variants: dict[str, tuple[Callable[[], torch.Tensor], int | None]] = {
        "loop1": (loop1, 1),
        "serial": (mapped("serial"), 1),
        "worker": (mapped(alone), None),
        "tmap-proc": (mapped(shared), None),
        "tsum-proc": (lambda: gradmap.tsum(f, items, executor=shared), None),
    }

    def run(name: str) -> tuple[float, float]:
        fn, threads = variants[name]
        for p in params:
            p.grad = None
        gc.collect()
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            start = time.perf_counter()
            loss = fn()
            middle = time.perf_counter()
            loss.backward()
            return middle - start, time.perf_counter() - middle
        finally:
            torch.set_num_threads(before)

    for _ in range(4):  # settle placement, kept items and the workers' caches
        for name in variants:
            run(name)
    times: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for rep in range(args.reps):
        names = list(variants)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            times[name].append(run(name))

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:9.2f}"

    n = len(items)
    load = os.getloadavg()[0]
    print(
        f"{args.workload}: {n} elements, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"medians of {args.reps} interleaved reps, load average {load:.2f}"
    )
    print(f"{'variant':<11}{'fwd ms':>9}{'bwd ms':>9}{'total':>9}")
    for name, pairs in times.items():
        fwd, bwd = [a for a, _ in pairs], [b for _, b in pairs]
        print(f"{name:<11}{ms(fwd)}{ms(bwd)}{ms([a + b for a, b in pairs])}")

    caller = _transport.ProcessTransport
    for api in ("tmap-proc", "tsum-proc"):
        spent: Timings = collections.defaultdict(list)
        own: collections.Counter[str] = collections.Counter()

        def local(transport: Any, call: Any, own: collections.Counter[str] = own) -> str:
            own[call.method] += 1
            return f"own chunks ({call.method})"

        def f_payload(obj: Any, table: Any, share: bool = False) -> str | None:
            return "pickling f" if share else None

        with (
            _counted(_map, "dumps", spent, f_payload),
            _counted(_map._Driver, "pack_items", spent, lambda *a: "checking kept items"),
            _counted(_map, "loads_results", spent, lambda *a: "reading answers"),
            _counted(caller, "_run_local", spent, local),
            _counted(caller, "_wait_remote", spent, lambda *a: "waiting for a worker"),
        ):
            walls = [sum(run(api)) for _ in range(args.reps)]
        wall = statistics.median(walls) * 1e3
        print(f"\n{api}: the caller's time per call (median call {wall:.2f} ms)")
        for key, values in spent.items():
            print(f"  {key:<28}{sum(values) / args.reps * 1e3:9.2f} ms")
        for method, count in own.items():
            print(f"  chunks the caller ran ({method}): {count / args.reps:.1f} a call")
    alone.shutdown()
    shared.shutdown()


if __name__ == "__main__":
    main()
