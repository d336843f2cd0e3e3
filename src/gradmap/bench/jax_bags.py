"""The ragged-bags workload in JAX: the plain loops over a per-shape ``jax.jit`` against
``gradmap.jax.tmap`` and ``gradmap.jax.tsum`` (needs ``gradmap[jax]``).

Bags of 5-200 instances x 64 features go through a shared MLP 64-128-128-1; a bag's loss is the
squared error of the mean prediction against its target, as ``ragged_bags`` in
``gradmap.bench.workloads``. Every bag has its own shape, so ``jax.jit(bag_loss)`` compiles once
per shape: the first run of every variant pays the compilations, the timed runs after it do not.

Variants (each computes the total loss and its gradient to the parameters):

- ``loop``: ``jax.value_and_grad`` of ``sum(bag_loss_jit(p, bag) for bag in bags)``, the plain
  loop that ``tmap`` replaces.
- ``loop_vg``: ``for bag in bags: jax.jit(jax.value_and_grad(bag_loss))(p, bag)``, summing the
  gradients by hand: the fastest serial way, one compiled call per bag.
- ``tmap``: ``jax.value_and_grad`` of ``sum(gradmap.jax.tmap(lambda bag: bag_loss_jit(p, bag),
  bags))`` on the shared thread pool.
- ``serial``: the same with ``executor="serial"`` (the map's machinery, no threads).
- ``tsum``: ``jax.value_and_grad`` of ``gradmap.jax.tsum(lambda bag: bag_loss_jit(p, bag),
  bags)`` on the shared thread pool: each bag one compiled ``value_and_grad`` step.
- ``tsum_serial``: ``tsum`` with ``executor="serial"``: its per-bag time less ``loop_vg``'s is
  gradmap's own cost per element (the line under the table).
- ``raw``: the ``loop_vg`` calls on plain threads (one per core, chunks of 4 bags taken in turn,
  each thread's sums added at the end), no gradmap: what threads can gain on this machine at
  all, the ceiling of ``tsum`` (XLA:CPU already runs one call's large operations on several
  cores, so the loop itself keeps more than one core busy: the ``cores`` column).
- ``padded``: ``jax.jit(jax.value_and_grad)`` of a ``vmap`` over the bags padded to the largest
  and masked: one compilation, no map at all.

``concurrency()`` runs the measurement behind NOTE [threads on XLA:CPU, measured] in
``gradmap/_jax/_map.py``: whether jitted calls dispatched from several threads overlap.

Run: ``python -m gradmap.bench.jax_bags [--n N] [--reps R] [--workers W] [--concurrency]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["VARIANTS", "bag_loss", "concurrency", "make_bags", "run", "main"]

VARIANTS = ("loop", "loop_vg", "tmap", "serial", "tsum", "tsum_serial", "raw", "padded")
SIZES = (64, 128, 128, 1)
MIN_SIZE, MAX_SIZE = 5, 200

Params = list[tuple[Any, Any]]
Bag = tuple[Any, Any]


def make_bags(seed: int, n: int) -> tuple[Params, list[Bag]]:
    """Deterministic parameters and ``n`` bags ``(x, y)``: ``x`` of shape ``(5..200, 64)``."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    params = [
        (
            jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            jnp.asarray(rng.uniform(-0.1, 0.1, b), jnp.float32),
        )
        for a, b in itertools.pairwise(SIZES)
    ]
    sizes = rng.integers(MIN_SIZE, MAX_SIZE + 1, n)
    bags = [
        (
            jnp.asarray(rng.standard_normal((int(size), SIZES[0])), jnp.float32),
            jnp.asarray(rng.standard_normal(()), jnp.float32),
        )
        for size in sizes
    ]
    return params, bags


def _mlp(params: Params, x: Any) -> Any:
    import jax

    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def bag_loss(params: Params, bag: Bag) -> Any:
    """The loss of one bag: squared error of the mean prediction."""
    x, y = bag
    return (_mlp(params, x).mean() - y) ** 2


def _variants(workers: int | None) -> dict[str, Callable[[Params, list[Bag]], Any]]:
    """Each variant: ``(params, bags) -> (total loss, gradient)``."""
    import jax
    import jax.numpy as jnp

    import gradmap.jax as gmj

    loss_jit = jax.jit(bag_loss)
    value_and_grad_jit = jax.jit(jax.value_and_grad(bag_loss))

    def loop(params: Params, bags: list[Bag]) -> Any:
        return jax.value_and_grad(lambda p: sum(loss_jit(p, bag) for bag in bags))(params)

    def loop_vg(params: Params, bags: list[Bag]) -> Any:
        total, grad = None, None
        for bag in bags:
            value, g = value_and_grad_jit(params, bag)
            total = value if total is None else total + value
            grad = g if grad is None else jax.tree_util.tree_map(jnp.add, grad, g)
        return total, grad

    def mapped(executor: str | None) -> Callable[[Params, list[Bag]], Any]:
        def total(params: Params, bags: list[Bag]) -> Any:
            def loss(p: Params) -> Any:
                losses = gmj.tmap(
                    lambda bag: loss_jit(p, bag), bags, executor=executor, workers=workers
                )
                return sum(losses)  # as the loop sums (jnp.stack costs twice as much under AD)

            return jax.value_and_grad(loss)(params)

        return total

    def summed(executor: str | None) -> Callable[[Params, list[Bag]], Any]:
        def total(params: Params, bags: list[Bag]) -> Any:
            def loss(p: Params) -> Any:
                return gmj.tsum(
                    lambda bag: loss_jit(p, bag), bags, executor=executor, workers=workers
                )

            return jax.value_and_grad(loss)(params)

        return total

    def raw(params: Params, bags: list[Bag]) -> Any:
        chunks = [bags[i : i + 4] for i in range(0, len(bags), 4)]
        taken = iter(range(len(chunks)))
        lock = threading.Lock()
        parts: list[Any] = [None] * len(chunks)

        def work() -> None:
            while True:
                with lock:
                    k = next(taken, None)
                if k is None:
                    return
                parts[k] = loop_vg(params, chunks[k])

        threads = [threading.Thread(target=work) for _ in range(workers or _cores())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total, grad = parts[0]
        for value, g in parts[1:]:
            total, grad = total + value, jax.tree_util.tree_map(jnp.add, grad, g)
        return total, grad

    @jax.jit
    def padded_value_and_grad(params: Params, x: Any, mask: Any, y: Any) -> Any:
        def one(p: Params, x: Any, mask: Any, y: Any) -> Any:
            prediction = (_mlp(p, x)[:, 0] * mask).sum() / mask.sum()
            return (prediction - y) ** 2

        def loss(p: Params) -> Any:
            return jax.vmap(one, in_axes=(None, 0, 0, 0))(p, x, mask, y).sum()

        return jax.value_and_grad(loss)(params)

    padding: dict[int, tuple[Any, Any, Any]] = {}

    def padded(params: Params, bags: list[Bag]) -> Any:
        key = id(bags)
        if key not in padding:  # padding is data preparation, done once, outside the timing
            longest = max(x.shape[0] for x, _ in bags)
            x = jnp.stack([jnp.pad(x, ((0, longest - x.shape[0]), (0, 0))) for x, _ in bags])
            lengths = jnp.array([x.shape[0] for x, _ in bags])
            mask = (jnp.arange(longest)[None, :] < lengths[:, None]).astype(x.dtype)
            padding.clear()
            padding[key] = (x, mask, jnp.stack([y for _, y in bags]))
        return padded_value_and_grad(params, *padding[key])

    return {
        "loop": loop,
        "loop_vg": loop_vg,
        "tmap": mapped(None),
        "serial": mapped("serial"),
        "tsum": summed(None),
        "tsum_serial": summed("serial"),
        "raw": raw,
        "padded": padded,
    }


def _max_rel_diff(grad: Any, reference: Any) -> float:
    import jax
    import numpy as np

    worst = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(reference)):
        g, r = np.asarray(g), np.asarray(r)
        worst = max(worst, float(np.max(np.abs(g - r)) / max(float(np.max(np.abs(r))), 1e-30)))
    return worst


def run(
    n: int = 256,
    reps: int = 5,
    variants: Sequence[str] = VARIANTS,
    workers: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Time the variants, interleaved (the starting variant rotates from one repetition to the
    next), after one untimed run each that compiles; check every gradient against ``loop``'s.

    Returns:
        Per variant: ``first_s`` (the compiling run), ``times_s`` (the timed runs), ``median_s``,
        ``per_bag_us`` and ``max_rel_grad_diff`` (against ``loop``; ``None`` for ``loop``).
    """
    import jax

    params, bags = make_bags(seed, n)
    table = _variants(workers)
    names = [name for name in VARIANTS if name in variants]
    results: dict[str, dict[str, Any]] = {
        name: {"times_s": [], "max_rel_grad_diff": None} for name in names
    }
    reference = None
    if "loop" not in names:
        reference = jax.block_until_ready(table["loop"](params, bags))[1]
    for name in names:
        start = time.perf_counter()
        _, grad = jax.block_until_ready(table[name](params, bags))
        results[name]["first_s"] = time.perf_counter() - start
        if name == "loop":
            reference = grad
        if progress:
            progress(f"{name}: first run (compiles) {results[name]['first_s']:.2f} s")
    for rep in range(reps):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            start, cpu = time.perf_counter(), time.process_time()
            _, grad = jax.block_until_ready(table[name](params, bags))
            results[name]["times_s"].append(time.perf_counter() - start)
            results[name].setdefault("cpu_s", []).append(time.process_time() - cpu)
            if name != "loop":
                diff = _max_rel_diff(grad, reference)
                previous = results[name]["max_rel_grad_diff"] or 0.0
                results[name]["max_rel_grad_diff"] = max(previous, diff)
        if progress:
            progress(f"rep {rep + 1}/{reps} done")
    for result in results.values():
        result["median_s"] = statistics.median(result["times_s"])
        result["per_bag_us"] = result["median_s"] / n * 1e6
        if result["times_s"]:
            result["cores_busy"] = sum(result["cpu_s"]) / sum(result["times_s"])
    return results


def format_results(results: dict[str, dict[str, Any]], n: int) -> str:
    """The table: time per variant and speed-up against ``loop`` and against ``loop_vg`` (the
    loop of jitted ``value_and_grad`` calls, the fastest serial way: the baseline of
    ``tsum``)."""
    base = results.get("loop", {}).get("median_s")
    base_vg = results.get("loop_vg", {}).get("median_s")
    lines = [
        f"JAX ragged bags, N={n}, cores={_cores()}, jax {_jax_version()}",
        f"{'variant':<11} {'first run':>10} {'median':>10} {'per bag':>10} {'cores':>6} "
        f"{'vs loop':>8} {'vs loop_vg':>11} {'grad rel diff':>14}",
    ]
    for name, r in results.items():
        speedup = f"{base / r['median_s']:.2f}x" if base else "-"
        speedup_vg = f"{base_vg / r['median_s']:.2f}x" if base_vg else "-"
        diff = r["max_rel_grad_diff"]
        busy = r.get("cores_busy")
        lines.append(
            f"{name:<11} {r['first_s']:>9.2f}s {r['median_s'] * 1e3:>8.1f}ms "
            f"{r['per_bag_us']:>8.0f}us {'-' if busy is None else f'{busy:.2f}':>6} "
            f"{speedup:>8} {speedup_vg:>11} {'-' if diff is None else f'{diff:.1e}':>14}"
        )
    per_bag = {name: r["per_bag_us"] for name, r in results.items()}
    if "tsum_serial" in per_bag and "loop_vg" in per_bag:
        lines.append(
            f"gradmap's own cost per element: tsum_serial - loop_vg = "
            f"{per_bag['tsum_serial'] - per_bag['loop_vg']:+.0f} us"
        )
    if "raw" in per_bag and base_vg:
        lines.append(
            f"what threads allow here (raw threads, no gradmap): "
            f"{base_vg / results['raw']['median_s']:.2f}x loop_vg"
        )
    return "\n".join(lines)


def _cores() -> int:
    from gradmap._executors import available_cores

    return available_cores()


def _jax_version() -> str:
    import jax

    return str(jax.__version__)


# --------------------------------------------------------------------------------------------
# Do jitted calls from several threads overlap on XLA:CPU?

_PROBE = r"""
import os, sys, threading, time
mode, devices, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
wait_each = not mode.endswith("-async")
mode = mode.removesuffix("-async")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
import jax, jax.numpy as jnp, numpy as np
if mode == "sleep":
    def nap(x):
        time.sleep(0.02)
        return np.asarray(x)
    g = jax.jit(lambda x: jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1)
    shape = (4,)
else:
    g = jax.jit(lambda x: jax.lax.fori_loop(
        0, 3000, lambda i, x: jnp.sin(x) * 1.0001 + jnp.cos(x), x))
    shape = (16, 16)
devs = jax.devices()
xs = [jax.device_put(jnp.ones(shape) * 0.01, devs[t % len(devs)]) for t in range(threads)]
for x in xs:
    g(x).block_until_ready()
def work(t):
    outs = []
    for _ in range(calls // threads):
        outs.append(g(xs[t]))
        if wait_each:
            outs[-1].block_until_ready()
    jax.block_until_ready(outs)
best = None
for _ in range(3):
    c0, t0 = time.process_time(), time.perf_counter()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if best is None or wall < best[0]:
        best = (wall, cpu)
print(best[0], best[1])
"""


def concurrency(calls: int = 40) -> list[str]:
    """Whether jitted calls dispatched from several threads run at the same time on XLA:CPU.

    Each configuration runs in a fresh interpreter (``XLA_FLAGS`` must be set before JAX is
    imported): ``sleep`` jits a 20 ms host sleep (no CPU contention: serialised executions take
    ``calls x 20 ms`` whatever the threads), ``compute`` a chain of 3000 small elementwise steps
    (too small for XLA to split over its own threads; ``calls x 5``). Threads x devices: 1x1, 2x1,
    2x2, 4x1. Each thread waits for every call; ``sleep-async`` waits only at the end.

    Returns:
        One line per configuration: wall time, ms per call, and CPU cores busy.
    """
    lines = []
    for mode, count in (("sleep", calls), ("sleep-async", calls), ("compute", calls * 5)):
        for threads, devices in ((1, 1), (2, 1), (2, 2), (4, 1)):
            out = subprocess.run(
                [sys.executable, "-c", _PROBE, mode, str(devices), str(threads), str(count)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            ).stdout.split()
            wall, cpu = float(out[-2]), float(out[-1])
            lines.append(
                f"{mode:<11} threads={threads} devices={devices}: {count} calls in "
                f"{wall * 1e3:6.0f} ms ({wall / count * 1e3:5.2f} ms/call), "
                f"{cpu / wall:4.2f} cores busy"
            )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradmap.bench.jax_bags``; returns the exit status (1 on a gradient
    mismatch, 2 when JAX is missing)."""
    parser = argparse.ArgumentParser(
        prog="gradmap bench-jax",
        description="JAX ragged bags: the plain loops over a per-shape jax.jit against "
        "gradmap.jax.tmap and gradmap.jax.tsum, forward and backward, with a gradient check.",
    )
    parser.add_argument("-n", "--n", type=int, default=256, help="bags (default 256)")
    parser.add_argument("--quick", action="store_true", help="32 bags, 3 reps")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--workers", type=int, default=None, help="workers of tmap and tsum")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    parser.add_argument("--tol", type=float, default=1e-4, help="largest relative grad diff")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--concurrency",
        action="store_true",
        help="measure whether jitted calls from several threads overlap, then exit",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    try:
        import jax  # noqa: F401
    except ImportError:
        print("gradmap bench-jax: needs JAX: pip install 'gradmap[jax]'", file=sys.stderr)
        return 2
    if args.concurrency:
        for line in concurrency():
            print(line, flush=True)
        return 0
    n, reps = (32, 3) if args.quick else (args.n, args.reps)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = run(n, reps, variants, args.workers, args.seed, None if args.quiet else progress)
    print(format_results(results, n), flush=True)
    worst = max((r["max_rel_grad_diff"] or 0.0 for r in results.values()), default=0.0)
    return 1 if worst > args.tol else 0


if __name__ == "__main__":
    sys.exit(main())
