"""The speed-up plot: ``tmap``'s speed-up over the plain loop against the number of workers.

matplotlib is an optional extra (``pip install 'gradmap[plot]'``) and is imported only here, when a
plot is asked for.
"""

from __future__ import annotations

from typing import Any

from gradmap.bench.runner import BenchResult

__all__ = ["PlotUnavailableError", "plot_speedup", "require_matplotlib", "sweep_points"]

INSTALL_HINT = "pip install 'gradmap[plot]'"


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """Import matplotlib's ``pyplot`` with a file-only backend.

    Returns:
        The ``matplotlib.pyplot`` module.

    Raises:
        PlotUnavailableError: matplotlib is missing; the message says how to install it.
    """
    try:
        import matplotlib
    except ImportError as error:
        raise PlotUnavailableError(
            f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sweep_points(result: BenchResult) -> dict[str, list[tuple[int, float]]]:
    """Collect ``(workers, speed-up)`` of the ``tmap:W`` (threads) and ``tmap-proc:W``
    (processes) variants per workload: keys ``"<workload> threads"``, ``"<workload> processes"``.

    Arguments:
        result: The bench results (run with a workers sweep).

    Returns:
        Points sorted by workers, per workload name; workloads without points are left out.
    """
    points = {}
    for workload in result.workloads:
        for prefix, label in (("tmap:", "threads"), ("tmap-proc:", "processes")):
            series = []
            for variant in workload.variants.values():
                speedup = workload.speedup(variant.name)
                if variant.name.startswith(prefix) and variant.workers and speedup is not None:
                    series.append((variant.workers, speedup))
            if series:
                points[f"{workload.name} {label}"] = sorted(series)
    return points


def plot_speedup(result: BenchResult, path: str) -> None:
    """Draw speed-up against workers, one line per workload, and save it.

    Arguments:
        result: The bench results (run with a workers sweep).
        path: Image file to write (the format follows the extension, e.g. ``.png``).

    Raises:
        PlotUnavailableError: matplotlib is missing.
    """
    plt = require_matplotlib()
    env = result.environment
    cores = env["cores"]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name, series in sweep_points(result).items():
        workers, speedups = zip(*series, strict=True)
        style = "--" if name.endswith("processes") else "-"
        ax.plot(workers, speedups, marker="o", linestyle=style, label=name)
    ax.plot([1, cores], [1, cores], linestyle=":", color="grey", label="linear")
    ax.axhline(1.0, linestyle="--", color="black", linewidth=0.8)
    ax.set_xlabel("workers")
    ax.set_ylabel("speed-up vs best plain loop (fwd+bwd)")
    ax.set_xticks(range(1, cores + 1))
    ax.set_title(f"gradmap.tmap, threads and processes, {cores} cores, torch {env['torch']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
