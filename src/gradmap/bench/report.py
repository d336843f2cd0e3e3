"""Presenting bench results: the text table and the JSON record."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from gradmap.bench.runner import BenchResult, VariantResult, WorkloadResult

__all__ = ["format_overhead", "format_own_cost", "format_table", "to_json", "write_json"]

_HEADER = (
    f"{'workload':<12} {'N':>6} {'us/elem':>8} {'cores':>5} {'thr':>3}  {'variant':<11} "
    f"{'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'speed-up':>8} {'eff':>5} "
    f"{'max|dgrad|':>10} {'rel':>8}"
)


def _efficiency(workload: WorkloadResult, variant: VariantResult, cores: int) -> float | None:
    """Return speed-up per worker for ``tmap`` variants (workers default to the core count)."""
    speedup = workload.speedup(variant.name)
    if speedup is None or not variant.name.startswith("tmap"):
        return None
    return speedup / (variant.workers or cores)


def _row(workload: WorkloadResult, variant: VariantResult, env: dict[str, Any], first: bool) -> str:
    """Format one line of the table."""
    if first:
        per_element = workload.per_element_us
        lead = (
            f"{workload.name:<12} {workload.n:>6} "
            f"{'-' if per_element is None else f'{per_element:.1f}':>8} "
            f"{env['cores']:>5} {env['torch_threads']:>3}"
        )
    else:
        lead = " " * 38
    baseline = workload.baseline
    name = variant.name + ("*" if baseline is variant else "")
    speedup = workload.speedup(variant.name)
    efficiency = _efficiency(workload, variant, env["cores"])
    return (
        f"{lead}  {name:<11} {variant.median_fwd_s * 1e3:>9.2f} "
        f"{variant.median_bwd_s * 1e3:>9.2f} {variant.median_total_s * 1e3:>9.2f} "
        f"{'-' if speedup is None else f'{speedup:.2f}x':>8} "
        f"{'-' if efficiency is None else f'{efficiency:.2f}':>5} "
        f"{variant.max_abs_grad_diff:>10.1e} {variant.max_rel_grad_diff:>8.1e}"
    )


def _load(env: dict[str, Any]) -> str:
    """Format the 1-minute load average before and after the run."""
    before, after = env.get("load_average"), env.get("load_average_after")
    if not before:
        return "unknown"
    return f"{before[0]:.2f}" + (f" -> {after[0]:.2f}" if after else "")


def format_table(result: BenchResult) -> str:
    """Format the results as a text table with a header describing the run.

    Arguments:
        result: The bench results.

    Returns:
        The table, lines joined with newlines (no trailing newline).
    """
    env = result.environment
    config = result.config
    lines = [
        f"gradmap bench: {env['cores']} cores, torch {env['torch']} (intra-op threads "
        f"{env['torch_threads']}, inter-op {env['torch_interop_threads']}), Python "
        f"{env['python']}, gradmap {env['gradmap']}",
        f"medians of {config.reps} interleaved reps after {config.warmup} warm-up, seed "
        f"{config.seed}{', quick sizes' if config.quick else ''}, load average {_load(env)}",
        "* = baseline (faster plain loop); speed-up = baseline total / variant total; "
        "eff = speed-up / workers",
        "",
        _HEADER,
        "-" * len(_HEADER),
    ]
    for workload in result.workloads:
        for i, variant in enumerate(workload.variants.values()):
            lines.append(_row(workload, variant, env, first=i == 0))
    own = format_own_cost(result)
    if own:
        lines += ["", own]
    overhead = format_overhead(result)
    if overhead:
        lines += ["", overhead]
    return "\n".join(lines)


def format_own_cost(result: BenchResult) -> str:
    """gradmap's own work in the forward, per workload: the ``serial`` variant's forward (the
    loop plus the map's bookkeeping, in the caller's thread) over ``loop1``'s; empty unless both
    ran."""
    parts = []
    for workload in result.workloads:
        serial, loop1 = workload.variants.get("serial"), workload.variants.get("loop1")
        if serial is None or loop1 is None or not serial.fwd_s or not loop1.fwd_s:
            continue
        ratio = serial.median_fwd_s / loop1.median_fwd_s
        parts.append(f"{workload.name} {ratio:.2f}x")
    if not parts:
        return ""
    return "gradmap's own cost, serial forward / loop1 forward: " + ", ".join(parts)


def format_overhead(result: BenchResult) -> str:
    """Summarise the per-element cost of the map on the ``overhead`` workload.

    Arguments:
        result: The bench results.

    Returns:
        One line per map variant with its time per element and its excess over the baseline, in
        microseconds; empty if the ``overhead`` workload or its baseline was not run.
    """
    workload = next((w for w in result.workloads if w.name == "overhead"), None)
    if workload is None or workload.baseline is None:
        return ""
    base_us = workload.baseline.median_total_s / workload.n * 1e6
    lines = [
        f"per-element cost on f(x) = x * 2 (fwd+bwd): {workload.baseline.name} {base_us:.2f} us"
    ]
    for variant in workload.variants.values():
        if variant.name.startswith("tmap") or variant.name == "serial":
            us = variant.median_total_s / workload.n * 1e6
            lines.append(
                f"  {variant.name:<11} {us:8.2f} us/elem, overhead {us - base_us:+8.2f} us/elem"
            )
    return "\n".join(lines)


def _finite(value: float) -> float | None:
    """Return ``value``, or ``None`` where JSON has no number for it (inf, NaN)."""
    return value if math.isfinite(value) else None


def to_json(result: BenchResult) -> dict[str, Any]:
    """Convert the results to a JSON-serialisable mapping with every repetition's times.

    Arguments:
        result: The bench results.

    Returns:
        ``{"config", "environment", "workloads"}``; times in seconds; a non-finite gradient
        difference is written as ``null``.
    """
    workloads = []
    for workload in result.workloads:
        baseline = workload.baseline
        variants = {}
        for variant in workload.variants.values():
            variants[variant.name] = {
                "workers": variant.workers,
                "fwd_s": variant.fwd_s,
                "bwd_s": variant.bwd_s,
                "total_s": variant.total_s,
                "median_fwd_s": variant.median_fwd_s,
                "median_bwd_s": variant.median_bwd_s,
                "median_total_s": variant.median_total_s,
                "speedup": workload.speedup(variant.name),
                "efficiency": _efficiency(workload, variant, result.environment["cores"]),
                "max_abs_grad_diff": _finite(variant.max_abs_grad_diff),
                "max_rel_grad_diff": _finite(variant.max_rel_grad_diff),
                "grad_ok": variant.max_rel_grad_diff <= result.config.tolerance,
            }
        workloads.append(
            {
                "name": workload.name,
                "summary": workload.summary,
                "n": workload.n,
                "baseline": None if baseline is None else baseline.name,
                "per_element_us": workload.per_element_us,
                "variants": variants,
            }
        )
    return {
        "config": dataclasses.asdict(result.config),
        "environment": result.environment,
        "workloads": workloads,
    }


def write_json(result: BenchResult, path: str) -> None:
    """Write ``to_json(result)`` to a file.

    Arguments:
        result: The bench results.
        path: Destination file.
    """
    with open(path, "w", encoding="utf-8") as file:
        json.dump(to_json(result), file, indent=2)
        file.write("\n")
