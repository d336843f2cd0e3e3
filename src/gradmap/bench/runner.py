"""Running the bench: timing variants on workloads, interleaved, and checking their gradients.

For each workload, in this process, the variants run in turn within each repetition (A B C A B C
..., the starting variant rotating from one repetition to the next) so that drift in the machine's
speed spreads over all of them. Forward (total loss) and backward are timed separately with
``time.perf_counter``; gradients are reset before every run and compared with those of the plain
loop after every run, outside the timed region.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradmap.bench.variants import BASELINES, Variant, loop_loss
from gradmap.bench.workloads import Workload, get_workload

__all__ = [
    "BenchConfig",
    "BenchResult",
    "VariantResult",
    "WorkloadResult",
    "available_cores",
    "environment",
    "grad_difference",
    "measure",
    "run_bench",
    "run_workload",
    "stderr_progress",
]

Progress = Callable[[str], None]


def available_cores() -> int:
    """Return the number of CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _version(distribution: str) -> str | None:
    """Return an installed distribution's version, or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _load_average() -> list[float] | None:
    """Return the 1, 5 and 15 minute load averages, where the system has them."""
    try:
        return [round(load, 2) for load in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment() -> dict[str, Any]:
    """Describe the machine and the software the bench runs on.

    Returns:
        A JSON-serialisable mapping: cores, torch's default intra- and inter-op threads, versions
        of Python, torch and gradmap, the platform, and the load average (other work on the
        machine distorts timings, the default intra-op threads' above all).
    """
    return {
        "cores": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradmap": _version("gradmap"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "load_average": _load_average(),
    }


@dataclass
class VariantResult:
    """Measurements of one variant on one workload.

    Attributes:
        name: The variant's name.
        workers: ``workers`` given to ``tmap``, if any.
        fwd_s: Forward time of every timed repetition, in seconds.
        bwd_s: Backward time of every timed repetition, in seconds.
        max_abs_grad_diff: Largest absolute difference from the loop's gradients, over all runs.
        max_rel_grad_diff: Largest difference relative to the size of the loop's gradient (per
            tensor: ``max|g - g_loop| / max|g_loop|``), over all runs.
    """

    name: str
    workers: int | None = None
    fwd_s: list[float] = field(default_factory=list)
    bwd_s: list[float] = field(default_factory=list)
    max_abs_grad_diff: float = 0.0
    max_rel_grad_diff: float = 0.0

    @property
    def total_s(self) -> list[float]:
        """Forward plus backward time of every timed repetition, in seconds."""
        return [f + b for f, b in zip(self.fwd_s, self.bwd_s, strict=True)]

    @property
    def median_fwd_s(self) -> float:
        """Median forward time in seconds."""
        return statistics.median(self.fwd_s)

    @property
    def median_bwd_s(self) -> float:
        """Median backward time in seconds."""
        return statistics.median(self.bwd_s)

    @property
    def median_total_s(self) -> float:
        """Median of forward plus backward time in seconds."""
        return statistics.median(self.total_s)


@dataclass
class WorkloadResult:
    """Measurements of all variants on one workload.

    Attributes:
        name: The workload's name.
        summary: The workload's one-line description.
        n: Number of elements.
        variants: Results by variant name, in the order run.
    """

    name: str
    summary: str
    n: int
    variants: dict[str, VariantResult]

    @property
    def baseline(self) -> VariantResult | None:
        """The faster plain loop (by median total time), or ``None`` if no loop was run."""
        loops = [self.variants[name] for name in BASELINES if name in self.variants]
        return min(loops, key=lambda r: r.median_total_s, default=None)

    def speedup(self, name: str) -> float | None:
        """Return the baseline's median total time over the variant's, or ``None``."""
        baseline = self.baseline
        if baseline is None:
            return None
        return baseline.median_total_s / self.variants[name].median_total_s

    @property
    def per_element_us(self) -> float | None:
        """Mean time per element of the baseline (forward plus backward), in microseconds."""
        baseline = self.baseline
        return None if baseline is None else baseline.median_total_s / self.n * 1e6


@dataclass
class BenchConfig:
    """What to run.

    Attributes:
        workloads: Workload names, in order.
        sizes: Number of elements per workload name.
        variants: Variant names (see ``gradmap.bench.variants.VARIANT_NAMES``).
        reps: Timed repetitions per variant.
        warmup: Untimed runs per variant before timing.
        seed: Seed for the workloads' data and models.
        workers: ``workers`` for the ``tmap`` variant.
        sweep: Worker counts of the extra ``tmap:W`` variants.
        tolerance: Largest relative gradient difference accepted.
        quick: Whether this is a ``--quick`` run (recorded only).
    """

    workloads: list[str]
    sizes: dict[str, int]
    variants: list[str]
    reps: int = 5
    warmup: int = 1
    seed: int = 0
    workers: int | None = None
    sweep: list[int] = field(default_factory=list)
    tolerance: float = 1e-4
    quick: bool = False


@dataclass
class BenchResult:
    """Everything a bench run measured.

    Attributes:
        config: What was run.
        environment: The machine and software (see ``environment``).
        workloads: One result per workload, in order.
    """

    config: BenchConfig
    environment: dict[str, Any]
    workloads: list[WorkloadResult]

    def mismatches(self) -> list[tuple[str, str, float]]:
        """Return ``(workload, variant, relative difference)`` for gradients beyond tolerance."""
        return [
            (w.name, v.name, v.max_rel_grad_diff)
            for w in self.workloads
            for v in w.variants.values()
            if not v.max_rel_grad_diff <= self.config.tolerance
        ]


_REFERENCE = Variant("reference", loop_loss)
"""The plain loop with default settings, whose gradients every variant is checked against."""


def _reset_grads(params: Sequence[Tensor]) -> None:
    """Drop accumulated gradients."""
    for p in params:
        p.grad = None


def measure(workload: Workload[Any], variant: Variant) -> tuple[float, float, list[Tensor | None]]:
    """Run one forward and backward of a variant, timed.

    Arguments:
        workload: The workload.
        variant: The variant.

    Returns:
        ``(forward seconds, backward seconds, gradients of workload.params())``.
    """
    params = workload.params()
    _reset_grads(params)
    gc.collect()
    with variant.settings():
        start = time.perf_counter()
        total = variant.total_loss(workload)
        middle = time.perf_counter()
        total.backward()
        end = time.perf_counter()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    _reset_grads(params)
    return middle - start, end - middle, grads


def grad_difference(
    reference: Sequence[Tensor | None], grads: Sequence[Tensor | None]
) -> tuple[float, float]:
    """Compare gradients with reference gradients.

    Arguments:
        reference: Reference gradients (``None`` for a tensor that got none).
        grads: Gradients to check, in the same order.

    Returns:
        ``(max absolute difference, max relative difference)``; the relative difference of a
        tensor is its largest absolute difference over its reference's largest magnitude. A
        gradient missing on one side only counts as infinitely different.
    """
    max_abs = max_rel = 0.0
    for ref, got in zip(reference, grads, strict=True):
        if ref is None and got is None:
            continue
        if ref is None or got is None or ref.shape != got.shape:
            return float("inf"), float("inf")
        diff = float((got - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        max_abs = max(max_abs, diff)
        if diff > 0.0:
            max_rel = max(max_rel, diff / scale if scale > 0.0 else float("inf"))
        elif diff != diff:  # NaN
            return float("nan"), float("nan")
    return max_abs, max_rel


def run_workload(
    workload: Workload[Any],
    variants: Sequence[Variant],
    reps: int,
    warmup: int = 1,
    progress: Progress | None = None,
) -> WorkloadResult:
    """Time variants on one workload and check their gradients against the plain loop.

    Arguments:
        workload: The workload, already built.
        variants: The variants; those that do not apply to the workload are left out.
        reps: Timed repetitions per variant.
        warmup: Untimed runs per variant before timing (gradients are checked on them too).
        progress: Called with a line of progress after each repetition.

    Returns:
        The measurements.
    """
    applicable = [v for v in variants if v.applies_to(workload)]
    results = {v.name: VariantResult(v.name, workers=v.workers) for v in applicable}
    reference = measure(workload, _REFERENCE)[2]
    for variant in applicable:
        for _ in range(variant.settle):
            measure(workload, variant)
    for rep in range(warmup + reps):
        shift = rep % len(applicable) if applicable else 0
        for variant in applicable[shift:] + applicable[:shift]:
            fwd, bwd, grads = measure(workload, variant)
            result = results[variant.name]
            diff_abs, diff_rel = grad_difference(reference, grads)
            result.max_abs_grad_diff = _worst(result.max_abs_grad_diff, diff_abs)
            result.max_rel_grad_diff = _worst(result.max_rel_grad_diff, diff_rel)
            if rep >= warmup:
                result.fwd_s.append(fwd)
                result.bwd_s.append(bwd)
        if progress is not None:
            if rep < warmup:
                label = f"warm-up {rep + 1}/{warmup}"
            else:
                label = f"rep {rep - warmup + 1}/{reps}"
            progress(f"{workload.name} (N={len(workload.items)}): {label} done")
    return WorkloadResult(workload.name, workload.summary, len(workload.items), results)


def _worst(a: float, b: float) -> float:
    """Return the larger of two differences, NaN counting as largest."""
    if a != a or b != b:
        return float("nan")
    return max(a, b)


def run_bench(
    config: BenchConfig, variants: Sequence[Variant], progress: Progress | None = None
) -> BenchResult:
    """Run every configured workload.

    Arguments:
        config: What to run.
        variants: The variants (see ``gradmap.bench.variants.build_variants``).
        progress: Called with lines of progress.

    Returns:
        All measurements with the configuration and the environment.
    """
    env = environment()
    results = []
    # Objects alive now (torch's own included) are left out of garbage collection, so that the
    # collection before every measurement is cheap; undone at the end.
    gc.collect()
    gc.freeze()
    try:
        for name in config.workloads:
            cls = get_workload(name)
            n = config.sizes[name]
            if progress is not None:
                progress(f"{name} (N={n}): building")
            workload = cls.make(config.seed, n)
            results.append(run_workload(workload, variants, config.reps, config.warmup, progress))
            del workload
    finally:
        gc.unfreeze()
    env["load_average_after"] = _load_average()
    return BenchResult(config, env, results)


def stderr_progress() -> Progress:
    """Return a progress callback writing timestamped lines to standard error."""
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(
            f"[gradmap bench {time.perf_counter() - start:6.1f}s] {line}",
            file=sys.stderr,
            flush=True,
        )

    return progress
