"""Command line of ``gradmap bench``.

Examples::

    gradmap bench --quick                      # smoke run, under a minute on 2 cores
    gradmap bench                              # full sizes, 5 interleaved reps
    gradmap bench --workloads tree,ode --reps 9 --json bench.json --plot speedup.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradmap.bench.plot import PlotUnavailableError, plot_speedup, require_matplotlib
from gradmap.bench.report import format_table, write_json
from gradmap.bench.runner import BenchConfig, available_cores, run_bench, stderr_progress
from gradmap.bench.variants import BASELINES, VARIANT_NAMES, build_variants
from gradmap.bench.workloads import WORKLOADS

__all__ = ["build_parser", "main"]


def _names(text: str) -> list[str]:
    """Split a comma-separated list, dropping blanks."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _positive(text: str) -> int:
    """Parse a positive integer argument."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _counts(text: str) -> list[int]:
    """Parse a comma-separated list of positive worker counts, sorted, without repeats."""
    return sorted({_positive(part) for part in text.split(",") if part.strip()})


def _non_negative(text: str) -> int:
    """Parse a non-negative integer argument."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text}")
    return value


def _tolerance(text: str) -> float:
    """Parse a non-negative relative tolerance."""
    value = float(text)
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of ``gradmap bench``."""
    workloads = "\n".join(
        f"  {w.name:<12} N={w.default_n:<6} {w.summary}" for w in WORKLOADS.values()
    )
    parser = argparse.ArgumentParser(
        prog="gradmap bench",
        description="Time gradmap.tmap against the plain loop (and vmap where possible) on "
        "example workloads, forward and backward, and check that gradients match.",
        epilog=f"workloads:\n{workloads}\n\nvariants: {', '.join(VARIANT_NAMES)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: a smoke run of under a minute on 2 cores"
    )
    parser.add_argument(
        "--workloads",
        type=_names,
        default=list(WORKLOADS),
        help="comma-separated workloads to run (default: all)",
    )
    parser.add_argument(
        "--variants",
        type=_names,
        default=list(VARIANT_NAMES),
        help="comma-separated variants to run (default: all)",
    )
    parser.add_argument(
        "--reps", type=_positive, default=5, help="timed repetitions per variant (default: 5)"
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        default=1,
        help="untimed runs per variant before timing (default: 1)",
    )
    parser.add_argument(
        "--executor",
        default=None,
        choices=("threads", "serial", "processes", "ray"),
        help="executor of the tmap, tsum and remat variants: threads (default), serial, "
        "processes or ray",
    )
    parser.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help="workers of the tmap variant (default: the pool's default)",
    )
    parser.add_argument(
        "-n",
        "--n",
        type=_positive,
        default=None,
        dest="n",
        help="number of elements of every workload (overrides the sizes)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and models")
    parser.add_argument(
        "--tol",
        type=_tolerance,
        default=1e-4,
        help="largest relative gradient difference from the loop (default 1e-4)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the raw figures to FILE")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also time tmap with 1..cores workers and plot speed-up to FILE",
    )
    parser.add_argument(
        "--sweep",
        type=_counts,
        default=None,
        metavar="W,W,...",
        help="worker counts of the tmap:W and tmap-proc:W variants (default with --plot: "
        "1..cores); on a machine with many cores, e.g. 1,2,4,8,16",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also measure peak memory of loop, tmap and tmap(remat=True) on ragged_bags "
        "(N=1024; 128 with --quick), each in a fresh process",
    )
    parser.add_argument(
        "--jax",
        action="store_true",
        help="also run the JAX variant of ragged_bags (gradmap bench-jax; needs gradmap[jax])",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--list", action="store_true", help="list the workloads and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gradmap bench``.

    Arguments:
        argv: Arguments after ``bench`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when every gradient matched, 1 on a gradient mismatch, 2 when the run
        could not start (missing matplotlib for ``--plot``, ``gradmap.tmap`` not importable).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for workload in WORKLOADS.values():
            size = f"N={workload.default_n} (quick {workload.quick_n})"
            print(f"{workload.name:<12} {size:<20} {workload.summary}")
        return 0
    unknown = [name for name in args.workloads if name not in WORKLOADS]
    if unknown or not args.workloads:
        parser.error(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; known: "
            f"{', '.join(WORKLOADS)}"
        )
    unknown = [name for name in args.variants if name not in VARIANT_NAMES]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANT_NAMES)}")
    if not set(BASELINES) & set(args.variants):
        parser.error(f"--variants needs a baseline: {' or '.join(BASELINES)}")
    try:
        if args.plot:
            require_matplotlib()
        sweep = args.sweep or (list(range(1, available_cores() + 1)) if args.plot else [])
        variants = build_variants(
            args.variants, workers=args.workers, sweep=sweep, executor=args.executor
        )
    except (PlotUnavailableError, RuntimeError) as error:
        print(f"gradmap bench: {error}", file=sys.stderr)
        return 2

    sizes = {
        name: args.n or (WORKLOADS[name].quick_n if args.quick else WORKLOADS[name].default_n)
        for name in args.workloads
    }
    config = BenchConfig(
        workloads=args.workloads,
        sizes=sizes,
        variants=args.variants,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
        workers=args.workers,
        sweep=sweep,
        tolerance=args.tol,
        quick=args.quick,
    )
    result = run_bench(config, variants, progress=None if args.quiet else stderr_progress())
    print(format_table(result), flush=True)
    if args.memory:
        from gradmap.bench.memory import format_memory, measure_memory

        n_memory = 128 if args.quick else 1024
        rows = measure_memory("ragged_bags", n_memory, seed=args.seed)
        print(format_memory("ragged_bags", n_memory, rows), flush=True)
    jax_status = 0
    if args.jax:
        from gradmap.bench.jax_bags import main as jax_main

        jax_status = jax_main((["--quick"] if args.quick else []) + (["-q"] if args.quiet else []))
    if args.json:
        write_json(result, args.json)
    if args.plot:
        plot_speedup(result, args.plot)
    mismatches = result.mismatches()
    for workload_name, variant_name, rel in mismatches:
        print(
            f"gradmap bench: gradient mismatch: {workload_name}/{variant_name}: relative "
            f"difference {rel:.3g} > {args.tol:g}",
            file=sys.stderr,
        )
    return 1 if mismatches else jax_status
