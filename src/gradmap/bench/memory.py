"""Memory of one forward and backward: the loop, tmap storing graphs, tmap(remat=True), tsum.

Measured as the growth of the peak resident set size (``ru_maxrss``) over one forward + backward,
each variant in a fresh Python process (after building the workload, and after one warm-up run of
a tenth of the elements so that libraries and pools are loaded), with one intra-op thread: the
peak includes every tensor the graph keeps and every intermediate alive at once, whoever
allocated it. The time column is
the same run's forward + backward, one repetition, so it is only indicative; the timed table of
``gradmap bench`` is the one to read for speed.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

__all__ = ["MEMORY_VARIANTS", "format_memory", "measure_memory"]

MEMORY_VARIANTS = ("loop", "tmap", "remat", "tsum")


def _peak_kib() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _child(workload_name: str, n: int, variant: str, seed: int) -> dict[str, Any]:
    import torch

    import gradmap
    from gradmap.bench.workloads import get_workload

    torch.set_num_threads(1)  # the loop at its best on this workload; tmap's workers use 1
    workload = get_workload(workload_name).make(seed, n)

    def total_loss(items: list[Any]) -> torch.Tensor:
        if variant == "loop":
            return torch.stack([workload.f(x) for x in items]).sum()
        if variant == "tsum":
            return gradmap.tsum(workload.f, items)  # type: ignore[no-any-return]
        losses = gradmap.tmap(workload.f, items, remat=variant == "remat")
        return torch.stack(losses).sum()

    total_loss(workload.items[: max(1, n // 10)]).backward()  # warm up
    for p in workload.params():
        p.grad = None
    before = _peak_kib()
    t0 = time.perf_counter()
    total_loss(workload.items).backward()
    seconds = time.perf_counter() - t0
    return {"variant": variant, "extra_peak_mib": (_peak_kib() - before) / 1024, "seconds": seconds}


def measure_memory(workload: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Run each of ``MEMORY_VARIANTS`` in a fresh process and return its figures.

    Arguments:
        workload: a workload name (see ``gradmap bench --list``).
        n: its number of elements.
        seed: seed of data and model.

    Returns:
        One dict per variant: ``variant``, ``extra_peak_mib``, ``seconds``.
    """
    rows = []
    for variant in MEMORY_VARIANTS:
        code = (
            "import json, sys; from gradmap.bench.memory import _child; "
            f"print(json.dumps(_child({workload!r}, {n}, {variant!r}, {seed})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def format_memory(workload: str, n: int, rows: list[dict[str, Any]]) -> str:
    """The memory table, with each variant's peak and time relative to ``tmap`` (store)."""
    store = next(r for r in rows if r["variant"] == "tmap")
    lines = [
        f"memory: {workload}, N={n}; extra peak RSS of one forward+backward, fresh process each",
        f"{'variant':<8}{'extra peak MiB':>16}{'vs store':>10}{'time s':>9}{'vs store':>10}",
    ]
    for r in rows:
        mem = r["extra_peak_mib"] / max(store["extra_peak_mib"], 1e-9)
        tim = r["seconds"] / store["seconds"]
        lines.append(
            f"{r['variant']:<8}{r['extra_peak_mib']:>16.1f}{mem:>9.2f}x"
            f"{r['seconds']:>9.3f}{tim:>9.2f}x"
        )
    return "\n".join(lines)
