"""Draw the speed-up plot of ``gradmap bench --plot`` from a saved bench table.

``gradmap bench --plot FILE`` draws ``tmap``'s speed-up against the workers from the run it has
just made; this reads the ``tmap:W`` and ``tmap-proc:W`` rows of a table saved as text (such as
``benchmarks/results/scaling-16-cores-2026-12-04.txt``, which ``benchmarks/scaling.sh`` wrote)
and draws the same plot, so that a picture of a past run can be made again without timing
anything. The docs' "Choosing an executor" page shows the 16-core one:

    python benchmarks/plot_results.py benchmarks/results/scaling-16-cores-2026-12-04.txt \\
        docs/img/speedup-16-cores.svg
"""

from __future__ import annotations

import re
import sys


def sweeps(text: str) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """``"<workload> threads"`` / ``"<workload> processes"`` -> (workers, speed-up) points, and
    the cores of the machine, read off the table's rows."""
    points: dict[str, list[tuple[int, float]]] = {}
    workload, cores = "", 0
    for line in text.splitlines():
        head = re.match(r"^(\w+)\s+\d+\s+[\d.]+\s+(\d+)\s+\d+\s+", line)
        if head and head.group(1) != "workload":
            workload, cores = head.group(1), int(head.group(2))
        match = re.search(r"\s(tmap(?:-proc)?):(\d+)\s.*?\s([\d.]+)x\s", line)
        if match and workload:
            label = "processes" if match.group(1) == "tmap-proc" else "threads"
            points.setdefault(f"{workload} {label}", []).append(
                (int(match.group(2)), float(match.group(3)))
            )
    return points, cores


def main(source: str, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "gradmap"  # the same file for the same table
    import matplotlib.pyplot as plt

    with open(source) as f:
        text = f.read()
    points, cores = sweeps(text)
    torch = re.search(r"torch (\S+) \(intra-op", text)
    date = re.search(r"^# (\d{4}-\d\d-\d\d)T", text, re.M)
    fig, ax = plt.subplots(figsize=(7.2, 5.0))
    workloads = sorted({name.rsplit(" ", 1)[0] for name in points})
    colors = {w: f"C{k}" for k, w in enumerate(workloads)}  # one colour per workload
    for name, series in sorted(points.items()):
        workload, label = name.rsplit(" ", 1)
        workers, speedups = zip(*sorted(series), strict=True)
        style = "--" if label == "processes" else "-"
        ax.plot(workers, speedups, marker="o", linestyle=style, color=colors[workload])
    for workload in workloads:
        ax.plot([], [], color=colors[workload], label=workload)
    ax.plot([], [], color="black", linestyle="-", label="threads")
    ax.plot([], [], color="black", linestyle="--", label="processes")
    ax.plot([1, cores], [1, cores], linestyle=":", color="grey", label="linear")
    ax.axhline(1.0, linestyle="--", color="black", linewidth=0.8)
    ax.set_xlabel("workers")
    ax.set_ylabel("speed-up vs best plain loop (fwd+bwd)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({w for s in points.values() for w, _ in s}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    when = [date.group(1)] if date else []
    when += [f"torch {torch.group(1)}"] if torch else []
    ax.set_title(f"gradmap.tmap, threads and processes, {cores} cores\n({', '.join(when)})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    fig.savefig(target, metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    main(*sys.argv[1:3])
