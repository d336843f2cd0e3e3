"""A scaling model of a map on worker processes: predicted speed-up over the 1-thread loop.

An event simulation of how gradmap schedules one map (``src/gradmap/_remote/_schedule.py``,
NOTE [a pass over the actors]), fed with element costs and a few latencies; no timing is done
here. A map of ``n`` elements is cut into the plan's ~64 chunks (``_plan.plan_chunks``); with
``W`` workers, ``W - 1`` processes and the caller run them (``W = 1``: one process, the caller
only drives it). ``tmap`` is two passes (the forward on any worker, then each chunk's backward on
the worker that holds its graph); ``tsum`` one pass (each chunk's forward and backward in one call).

In a pass the *driver* (the caller's thread) is one serial resource:
- it sends a call (guided batch size, at most twice the worker's chunks so far, single chunks in
  the last ``END`` per worker, a batch runs to the end of its group of the sum; at most ``depth``
  calls in flight per worker) for ``call`` seconds of its time; the call reaches the worker
  ``message`` seconds later;
- a worker runs its calls in order, ``work`` seconds per second of the loop's work;
- the answer reaches the driver ``message`` seconds later, which reads it for ``answer`` seconds
  per chunk, when it is free;
- with nothing to read, the driver runs one of its own chunks (single chunks, from the end of the
  queue, ``caller_work`` seconds per loop second): answers that arrive meanwhile wait for it.
Outside the passes the caller does ``serial`` seconds per map and ``element`` seconds per element
of its own (pickling ``f``, the kept items, building the results, the engine's backward over
them): Amdahl's part. A worker that has not started yet takes its first call ``start`` seconds
into the map.

Run: ``python benchmarks/scaling_model.py [--out FILE]``: calibrates on the 16-core table of
2026-12-04 (``benchmarks/results/scaling-16-cores-2026-12-04.txt``; figures copied below),
prints measured against predicted, where the 16th core's time goes, and predictions for 16 and
64 cores.
"""

from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass, replace

from gradmap._plan import plan_chunks
from gradmap._remote._schedule import END, GUIDED


@dataclass(frozen=True)
class Machine:
    """The costs of the model, in seconds (see the module's docstring)."""

    work: float = 1.0
    caller_work: float = 1.0
    call: float = 50e-6
    message: float = 125e-6
    answer: float = 20e-6
    serial: float = 0.0
    element: float = 0.0
    start: float = 0.0
    depth: int = 2
    caller_helps: bool = True


def _take(
    queue: deque[int], share: int, sent: int, caller: bool, group: int, free: bool
) -> list[int]:
    """One call's chunks, as ``run_pass``'s ``take``."""
    if caller and free:
        return [queue.pop()]
    size = max(1, min(-(-len(queue) // (GUIDED * share)), 2 * sent))
    if len(queue) <= END * share or caller:
        size = 1
    batch = [queue.popleft()]
    whole = not caller and len(queue) > GUIDED * share * group
    while queue and (len(batch) < size or (whole and queue[0] // group == batch[-1] // group)):
        batch.append(queue.popleft())
    return batch


def simulate_pass(
    costs: list[float],
    workers: int,
    m: Machine,
    owners: list[int] | None = None,
    group: int = 1,
    t0: float = 0.0,
) -> tuple[float, list[int]]:
    """One pass over chunks of loop seconds ``costs``; ``owners``: each chunk's worker (a
    backward pass), else any. Returns the time it ends and each chunk's worker."""
    helps = m.caller_helps and workers > 1
    caller = workers - 1 if helps else -1
    free: deque[int] = deque(range(len(costs))) if owners is None else deque()
    owned: list[deque[int]] = [deque() for _ in range(workers)]
    if owners is not None:
        for chunk, a in enumerate(owners):
            owned[a].append(chunk)
    ran = [-1] * len(costs)
    load, sent = [0] * workers, [0] * workers
    busy_until = [t0 + m.start] * workers
    inflight: list[tuple[float, int, list[int]]] = []  # (answer at the driver, worker, chunks)
    local: deque[list[int]] = deque()
    t = t0
    while True:
        progress = True
        while progress:  # fill: as run_pass, one call per worker a round, until no room
            progress = False
            for a in range(workers):
                if load[a] >= m.depth or not (owned[a] or free):
                    continue
                progress = True
                queue = owned[a] if owned[a] else free
                share = 1 if queue is owned[a] else workers
                batch = _take(queue, share, sent[a], a == caller, group, queue is free)
                sent[a] += len(batch)
                load[a] += 1
                if a == caller:
                    local.append(batch)
                    continue
                t += m.call
                begin = max(t + m.message, busy_until[a])
                busy_until[a] = begin + m.work * sum(costs[c] for c in batch)
                inflight.append((busy_until[a] + m.message, a, batch))
        if not inflight and not local:
            return t, ran
        inflight.sort()
        if (inflight and inflight[0][0] <= t) or not local:
            arrive, a, batch = inflight.pop(0)
            t = max(t, arrive) + m.answer * len(batch)
        else:
            batch, a = local.popleft(), caller
            t += m.caller_work * sum(costs[c] for c in batch)
        load[a] -= 1
        for c in batch:
            ran[c] = a


def simulate_map(
    fwd: list[float], bwd: list[float], workers: int, m: Machine, api: str = "tmap"
) -> float:
    """Seconds of one map (``tmap``: forward and backward passes; ``tsum``: one pass) of
    elements whose loop costs are ``fwd`` and ``bwd``."""
    plan = plan_chunks(len(fwd))
    cf = [sum(fwd[slice(*plan.bounds(c))]) for c in range(plan.count)]
    cb = [sum(bwd[slice(*plan.bounds(c))]) for c in range(plan.count)]
    t = m.serial + m.element * len(fwd)
    if api == "tsum":
        end, _ = simulate_pass([f + b for f, b in zip(cf, cb)], workers, m, None, plan.group, t)
        return end
    end, owners = simulate_pass(cf, workers, m, None, plan.group, t)
    warm = replace(m, start=0.0)
    end, _ = simulate_pass(cb, workers, warm, owners, plan.group, end)
    return end


def speedup(
    fwd: list[float], bwd: list[float], workers: int, m: Machine, api: str = "tmap"
) -> float:
    """The loop's seconds over the map's."""
    return (sum(fwd) + sum(bwd)) / simulate_map(fwd, bwd, workers, m, api)


# ----------------------------------------------------------------------------------------------
# Calibration on the 16-core run of 2026-12-04 (copied from its results file, milliseconds)

#: workload: (N, loop1 forward, loop1 backward, serial total, tsum-proc at 16,
#:            {W: tmap-proc:W total})
TABLE_2026_12_04: dict[str, tuple[int, float, float, float, float, dict[int, float]]] = {
    "ragged_bags": (
        256,
        33.81,
        52.69,
        149.99,
        20.63,
        {1: 173.95, 2: 94.78, 4: 59.57, 8: 35.22, 16: 27.48},
    ),
    "small_bags": (
        2048,
        84.20,
        166.14,
        243.64,
        36.17,
        {1: 334.50, 2: 205.03, 4: 141.27, 8: 92.82, 16: 73.32},
    ),
    "tree": (
        256,
        178.35,
        387.63,
        651.19,
        58.52,
        {1: 501.27, 2: 304.64, 4: 173.73, 8: 101.98, 16: 66.49},
    ),
    "ode": (
        128,
        629.86,
        1506.30,
        2693.93,
        252.26,
        {1: 2592.87, 2: 1310.79, 4: 720.77, 8: 409.89, 16: 253.36},
    ),
    "gru": (
        64,
        150.16,
        416.13,
        1447.87,
        66.78,
        {1: 625.36, 2: 337.73, 4: 181.59, 8: 114.42, 16: 164.13},
    ),
}

#: The caller's own seconds per element on processes, outside the workers' work: the ``x * 2``
#: row of the same run (``tmap-proc:W`` overhead per element 60.6 / 49.0 / 41.6 / 33.3 / 33.7 us
#: at W = 1 / 2 / 4 / 8 / 16) fitted as ``s + p / W``: s = 32 us serial, p = 29 us on the workers.
ELEMENT = 32e-6

#: The share of an element's cost that does not grow with its size (a guess per workload: Python
#: calls per element against work per node, step or row).
FIXED_SHARE = {"ragged_bags": 0.5, "small_bags": 0.8, "tree": 0.1, "ode": 0.05, "gru": 0.1}


def element_sizes(name: str, n: int) -> list[float]:
    """Each element's size in the bench's data (seed 0): nodes, steps, rows."""
    from gradmap.bench.workloads import WORKLOADS

    items = WORKLOADS[name].make(0, n).items  # type: ignore[attr-defined]
    if name == "tree":
        return [2.0 * len(item.leaves) - 1 for item in items]
    if name == "ode":
        return [float(item.steps) for item in items]
    if name == "gru":
        return [float(len(item)) for item in items]
    return [float(len(item.x)) for item in items]


def element_costs(name: str) -> tuple[list[float], list[float]]:
    """Per-element loop seconds of forward and backward: the 1-thread loop's totals shared out
    in proportion to ``FIXED_SHARE + (1 - FIXED_SHARE) * size / mean size``."""
    n, fwd_ms, bwd_ms = TABLE_2026_12_04[name][:3]
    sizes = element_sizes(name, n)
    mean, fixed = sum(sizes) / n, FIXED_SHARE[name]
    weights = [fixed + (1 - fixed) * s / mean for s in sizes]
    total = sum(weights)
    return (
        [fwd_ms * 1e-3 * w / total for w in weights],
        [bwd_ms * 1e-3 * w / total for w in weights],
    )


def calibrate(name: str, element: float = ELEMENT) -> tuple[list[float], list[float], Machine]:
    """Element costs and a machine for one workload: ``work`` so that ``W = 1`` (one process,
    the caller only driving it) matches the table, then ``caller_work`` so that ``W = 2`` (one
    process and the caller) does. ``W = 4..16`` are then predictions."""
    sweep = TABLE_2026_12_04[name][5]
    fwd, bwd = element_costs(name)
    m = Machine(element=element)
    for _ in range(3):
        m = replace(m, work=m.work * sweep[1] * 1e-3 / simulate_map(fwd, bwd, 1, m))
    low, high = 0.2, 5.0  # the map's time grows with caller_work: bisect
    for _ in range(30):
        mid = (low + high) / 2
        slow = simulate_map(fwd, bwd, 2, replace(m, caller_work=mid)) > sweep[2] * 1e-3
        low, high = (low, mid) if slow else (mid, high)
    return fwd, bwd, replace(m, caller_work=(low + high) / 2)


def breakdown(fwd: list[float], bwd: list[float], workers: int, m: Machine) -> dict[str, float]:
    """Where a map's seconds go past ``loop / workers``, one cost switched off at a time."""
    ideal = (sum(fwd) + sum(bwd)) / workers
    full = simulate_map(fwd, bwd, workers, m)
    parts = {
        "worker work > loop": replace(m, work=1.0, caller_work=1.0),
        "caller's serial part": replace(m, element=0.0, serial=0.0),
        "latency (call, message, answer)": replace(m, call=0.0, message=0.0, answer=0.0),
        "caller's chunks (vs processes only)": replace(m, caller_work=m.work),
    }
    out = {"ideal": ideal, "model": full}
    for label, other in parts.items():
        out[label] = full - simulate_map(fwd, bwd, workers, other)
    # What is left with every cost above off: the schedule's tail (chunks of unequal cost).
    bare = replace(
        m, work=1.0, caller_work=1.0, element=0.0, serial=0.0, call=0.0, message=0.0, answer=0.0
    )
    out["tail imbalance (64 chunks)"] = simulate_map(fwd, bwd, workers, bare) - ideal
    return out


def report() -> str:
    lines = [
        "# scaling model (benchmarks/scaling_model.py) against the 16-core table of",
        "# 2026-12-04: tmap on processes, speed-up over the 1-thread loop",
        f"# machine: call {Machine.call * 1e6:.0f} us, message {Machine.message * 1e6:.0f} us,"
        f" answer {Machine.answer * 1e6:.0f} us/chunk, caller {ELEMENT * 1e6:.0f} us/element;"
        " work fitted at W=1",
        "",
    ]
    lines.append(
        f"{'workload':<16} {'W':>3} {'measured':>9} {'predicted':>10} {'diff':>7}"
        f" {'ms measured - predicted':>24}"
    )
    for name, (_, fwd_ms, bwd_ms, _, tsum16, sweep) in TABLE_2026_12_04.items():
        fwd, bwd, m = calibrate(name)
        loop = fwd_ms + bwd_ms
        rows = [(name, w, ms, "tmap") for w, ms in sweep.items()]
        rows.append((name + " tsum", 16, tsum16, "tsum"))
        for label, w, ms, api in rows:
            measured, predicted = loop / ms, speedup(fwd, bwd, w, m, api)
            gap = ms - loop / predicted
            lines.append(
                f"{label:<16} {w:>3} {measured:>8.2f}x {predicted:>9.2f}x "
                f"{(predicted - measured) / measured:>+6.0%} {gap:>+24.1f}"
            )
        lines.append(
            f"{'':<16}     a chunk costs {m.work:.2f}x the loop on a worker, "
            f"{m.caller_work:.2f}x in the caller (fitted at W = 1, 2)"
        )
    lines += [
        "",
        "# where tree's time goes on 16 and 64 workers (ms; each cost switched off alone)",
    ]
    fwd, bwd, m = calibrate("tree")
    for w in (16, 64):
        parts = breakdown(fwd, bwd, w, m)
        lines.append(f"W={w}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    lines += [
        "",
        "# PREDICTION (not measured): tmap / tsum on processes, speed-up over the 1-thread",
        "# loop, same element costs and latencies, cores = workers",
    ]
    lines.append("# first as modelled, then with what the model missed at W = 16 on that machine")
    lines.append("# (measured - predicted ms, where positive) kept as a serial part of every map")
    for name, (*_, sweep) in TABLE_2026_12_04.items():
        fwd, bwd, m = calibrate(name)
        gap = max(0.0, sweep[16] * 1e-3 - simulate_map(fwd, bwd, 16, m))
        for label, machine in (("", m), (f" +{gap * 1e3:.0f} ms", replace(m, serial=gap))):
            row = [
                f"{speedup(fwd, bwd, w, machine):.1f}/{speedup(fwd, bwd, w, machine, 'tsum'):.1f}"
                for w in (16, 32, 64)
            ]
            lines.append(
                f"{name + label:<18} 16: {row[0]:>10}   32: {row[1]:>10}   64: {row[2]:>10}"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    text = report()
    print(text, end="")
    if args.out:
        with open(args.out, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
