"""``gradmap.compare``: time the loop, threads and processes on the user's own ``f`` and items, and
say which to use.

NOTE [which executor]:
    Which executor is fastest depends on ``f``, not on gradmap: a forward of many small ops holds
    the GIL and runs no faster on threads than in one (threads still run the backward in
    parallel); a forward of large ops scales on threads; processes run any forward in parallel
    but pay for pickling the items and results and for their round trips. So gradmap measures
    rather than guesses: each candidate computes the same loss (the sum of every floating-point
    result leaf) and its backward, interleaved with the others, several times; the medians of
    forward + backward are compared with the plain loop's, and every run's values and gradients
    are checked against the loop's (NOTE [every run against the loop]). The ``.grad`` of every
    leaf the loss reaches is put back as it was, and so is the global random generator, so a
    comparison in the middle of training changes nothing. An ``f`` that draws random numbers
    (dropout) draws other numbers in a map than in the loop (NOTE [random numbers per
    element]), so its results are not compared: the report says so rather than calling the
    difference an error.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._placement import EXPLORE

__all__ = ["Comparison", "compare"]

#: Untimed calls of each map before its warm-up: a map on threads measures where its forward
#: runs on its first calls (NOTE [forward placement]: the first, then ``EXPLORE`` alternating),
#: and a ``tmap`` learns from its first backward whether to pull its losses back early (NOTE
#: [tmap's losses pulled back early]); what a user's training loop runs is the steady state.
SETTLE = EXPLORE


@dataclass
class Row:
    """One candidate's medians (seconds) and its largest gradient difference from the loop."""

    name: str
    forward: float
    backward: float
    grad_error: float | None = None
    error: str | None = None
    #: Its values or gradients differed from the loop's in some run: never recommended.
    differs: bool = False

    @property
    def total(self) -> float:
        return self.forward + self.backward


@dataclass
class Comparison:
    """What [`compare`][gradmap.compare] measured.

    Attributes:
        rows: the faster loop first, then the other candidates, with median forward and backward
            seconds.
        best: the name of the fastest candidate whose gradients match the loop's (a loop if
            none beats the faster loop).
        cores: the cores available to the process.
    """

    rows: list[Row]
    best: str
    cores: int
    notes: list[str] = field(default_factory=list)

    def speedup(self, name: str) -> float | None:
        """The candidate's speed-up over the faster loop (forward + backward)."""
        loop = self.rows[0].total
        for row in self.rows:
            if row.name == name and row.error is None and row.total > 0:
                return loop / row.total
        return None

    def __str__(self) -> str:
        lines = [
            f"gradmap.compare ({self.cores} cores): median forward + backward vs the faster loop",
            f"{'candidate':<28} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'speed-up':>8}"
            f" {'max rel dgrad':>13}",
        ]
        for row in self.rows:
            if row.error is not None:
                lines.append(f"{row.name:<28} failed: {row.error}")
                continue
            speedup = self.speedup(row.name)
            grad = "-" if row.grad_error is None else f"{row.grad_error:.1e}"
            if row.differs:
                grad += " differs"
            lines.append(
                f"{row.name:<28} {row.forward * 1e3:9.2f} {row.backward * 1e3:9.2f} "
                f"{row.total * 1e3:9.2f} {speedup or 0:7.2f}x {grad:>13}"
            )
        lines.extend(self.notes)
        if self.best.startswith("loop"):
            lines.append(f"use: the plain {self.best} (no map was faster here)")
        else:
            lines.append(f"use: {self.best} ({self.speedup(self.best):.2f}x the loop)")
        return "\n".join(lines)


def compare(
    f: Callable[..., Any],
    *iterables: Iterable[Any],
    executors: Sequence[str] = ("threads", "processes"),
    tsum: bool = False,
    reps: int = 3,
    workers: int | None = None,
    tol: float = 1e-4,
) -> Comparison:
    """Time the plain loop, ``tmap`` (or ``tsum``) on each executor, on your ``f`` and items, and
    say which is fastest.

    Each candidate computes the sum of every floating-point leaf of every result and its
    ``backward()``, ``reps`` times, interleaved with the others (after untimed runs: one of
    each loop, ``1 + SETTLE`` of each map, which start the worker processes and let a map on
    threads settle where its forward runs, as it has in a training loop after its first few
    steps); the medians are compared with the loop's, and
    each candidate's gradients with the loop's (relative difference at most ``tol``, else it is
    not recommended). The ``.grad`` of every leaf is restored afterwards.

    Arguments:
        f, *iterables: as for ``tmap``; iterables are read once, into a list.
        executors: the executors to try (names ``tmap`` takes: ``"threads"``, ``"processes"``,
            ``"ray"``, ...).
        tsum: time ``gradmap.tsum`` instead of ``tmap`` (for a loss that is a sum over elements).
        reps: timed runs per candidate.
        workers: ``workers`` for every candidate (``None``: each executor's default).
        tol: the largest relative difference of values and gradients from the loop's that a
            candidate may show.

    Returns:
        A [`Comparison`][gradmap.Comparison]; ``print`` it for a table and a recommendation.

    Example:
        >>> report = gradmap.compare(bag_loss, bags, tsum=True)  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
    """
    import torch

    from ._api import tmap
    from ._api import tsum as sum_map
    from ._executors import available_cores

    if reps < 1:
        raise ValueError(f"gradmap.compare: reps must be at least 1, got {reps}")
    if isinstance(executors, str):
        executors = (executors,)  # one name, not its letters
    items = [list(it) for it in iterables]
    elements = list(zip(*items))
    if not elements:
        raise ValueError("gradmap.compare: there are no elements to time")
    mapped = sum_map if tsum else tmap
    label = "tsum" if tsum else "tmap"

    def loop() -> Any:
        results = [f(*args) for args in elements]
        return _loss(results)

    candidates: list[tuple[str, Callable[[], Any]]] = [("loop", loop)]
    if torch.get_num_threads() > 1:
        # The loop with one intra-op thread is often faster on small ops; the baseline is the
        # faster of the two loops, as in ``gradmap bench``.
        candidates.append(("loop, set_num_threads(1)", loop))
    for executor in executors:
        candidates.append(
            (f"{label}(executor={executor!r})", _mapped(mapped, f, items, executor, workers))
        )

    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in candidates}
    worst: dict[str, tuple[float, float, int, int]] = {}  # value, gradient error; runs off, runs
    failed: dict[str, str] = {}
    with torch.random.fork_rng(devices=[]):  # the generator is left as it was
        before = torch.default_generator.get_state()
        # The loop's untimed first run: what every run is checked against.
        _, _, reference = _timed(loop, None)
        drew = not torch.equal(before, torch.default_generator.get_state())
        for rep in range(-SETTLE, reps + 1):  # (untimed below 1)
            for name, run in candidates:
                if name in failed or (rep < 0 and name.startswith("loop")):
                    continue
                if rep == 0 and name == "loop":
                    continue  # (its first run was the reference)
                try:
                    forward, backward, got = _timed(run, 1 if name.endswith("(1)") else None)
                except Exception as exc:
                    if name.startswith("loop"):
                        raise  # nothing to compare with: f itself fails, or has no backward
                    failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                    continue
                if not (name.startswith("loop") or drew):  # NOTE [every run against the loop]
                    value_error, grad_error = _difference(got, reference, torch)
                    v, g, off, runs = worst.get(name, (0.0, 0.0, 0, 0))
                    bad = value_error > tol or grad_error > tol
                    worst[name] = (max(v, value_error), max(g, grad_error), off + bad, runs + 1)
                if rep > 0:
                    times[name].append((forward, backward))
    rows = []
    for name, _ in candidates:
        if name in failed:
            rows.append(Row(name, 0.0, 0.0, error=failed[name]))
            continue
        forward = statistics.median(t for t, _ in times[name])
        backward = statistics.median(t for _, t in times[name])
        error = worst[name][1] if name in worst else None
        rows.append(Row(name, forward, backward, error))
    baseline = min((r for r in rows if r.name.startswith("loop")), key=lambda r: r.total)
    rows.remove(baseline)
    rows.insert(0, baseline)
    best, best_total = baseline.name, baseline.total
    notes = []
    if drew:
        notes.append(
            "f draws random numbers: values and gradients not compared (a map draws per "
            "element, not from the loop's one stream)"
        )
    for row in rows[1:]:
        if row.error is not None or row.name.startswith("loop"):
            continue
        value_error, grad_error, off, runs = worst.get(row.name, (0.0, 0.0, 0, 0))
        if off:
            notes.append(_differs(row.name, value_error, grad_error, off, runs, tol))
            row.differs = True
            continue
        if row.total < best_total:
            best, best_total = row.name, row.total
    return Comparison(rows, best, available_cores(), notes)


def _mapped(
    mapped: Callable[..., Any],
    f: Callable[..., Any],
    items: list[list[Any]],
    executor: str,
    workers: int | None,
) -> Callable[[], Any]:
    def run() -> Any:
        return _loss(mapped(f, *items, executor=executor, workers=workers))

    return run


def _loss(results: Any) -> Any:
    import torch

    from ._tree import flatten

    leaves, _ = flatten(results)
    terms = [
        t.sum()
        for t in leaves
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not terms:
        raise ValueError(
            "gradmap.compare: f's results have no floating-point tensor that requires grad, "
            "so there is no backward to time"
        )
    return torch.stack(terms).sum()


def _timed(run: Callable[[], Any], threads: int | None) -> tuple[float, float, Any]:
    """One run (with ``threads`` intra-op threads, if given): forward seconds, backward seconds,
    and the loss with the gradients of the leaves (the leaves' ``.grad`` put back as it
    was)."""
    import torch

    if threads is None:
        return _timed_as_is(run)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _timed_as_is(run)
    finally:
        torch.set_num_threads(previous)


def _timed_as_is(run: Callable[[], Any]) -> tuple[float, float, Any]:
    t0 = time.perf_counter()
    loss = run()
    t1 = time.perf_counter()
    leaves = _leaves(loss)
    saved = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    try:
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        got = [leaf.grad for leaf in leaves]
    finally:
        for leaf, grad in zip(leaves, saved):
            leaf.grad = grad
    return t1 - t0, t3 - t2, (loss.detach(), got)


def _leaves(loss: Any) -> list[Any]:
    """The leaves that require grad the loss reaches, in a fixed order."""
    seen: set[int] = set()
    found: set[int] = set()
    kept: list[Any] = []
    leaves = []
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        kept.append(node)  # (so that no id is reused meanwhile)
        variable = getattr(node, "variable", None)
        # By the tensor: a node may come with a new Python wrapper each time (free-threaded).
        if variable is not None and id(variable) not in found:
            found.add(id(variable))
            leaves.append(variable)
        stack.extend(child for child, _ in node.next_functions)
    leaves.sort(key=id)  # the same tensor objects whichever candidate built the graph
    return leaves


def _difference(got: Any, want: Any, torch: Any) -> tuple[float, float]:
    """The largest relative differences of a run's loss and of its gradients from the
    reference run's (inf where the gradients differ in shape, count or which are ``None``)."""
    (loss, grads), (want_loss, want_grads) = got, want
    value = _relative(loss, want_loss)
    if len(grads) != len(want_grads):
        return value, float("inf")
    worst = 0.0
    for a, b in zip(grads, want_grads):
        if a is None or b is None:
            if (a is None) != (b is None):
                return value, float("inf")
            continue
        worst = max(worst, _relative(a, b))
    return value, worst


def _relative(a: Any, b: Any) -> float:
    """The largest difference of ``a`` from ``b``, relative to ``b``'s largest entry."""
    if a.shape != b.shape:
        return float("inf")
    scale = float(b.abs().max()) if b.numel() else 0.0
    if not a.numel():
        return 0.0
    return float((a - b).abs().max()) / (scale or 1.0)


def _differs(name: str, value: float, grad: float, off: int, runs: int, tol: float) -> str:
    """The note for a candidate whose values or gradients differed from the loop's.

    NOTE [every run against the loop]:
        A race shows in some calls only (a library that keeps process-wide state, entered by
        two elements on two threads at once), so every run of every candidate, the untimed
        ones included, is checked against one untimed run of the loop: its loss (the sum the
        timing differentiates) and every gradient. A candidate that differs in any run is said
        to in plain words and never recommended: a faster wrong answer is no answer.
    """
    what = []
    if value > tol:
        what.append(f"values {value:.1e}")
    if grad > tol:
        what.append(f"gradients {grad:.1e}")
    where = "threads" if "threads" in name else "worker processes" if "process" in name else ""
    why = (
        "f or a library it calls is not safe on threads (it keeps state every thread of the "
        "process shares); use executor='processes' or the loop"
        if where == "threads"
        else "f or a library it calls depends on state of your process that other processes "
        "do not share (a module global, a library's store); use executor='threads' if f is "
        "safe there, or the loop"
        if where
        else "f or a library it calls does not give the loop's results on this executor"
    )
    return (
        f"{name}: differs from the loop ({', '.join(what)} off, relative, in {off} of "
        f"{runs} runs): {why}. Not recommended."
    )
