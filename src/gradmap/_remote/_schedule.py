"""Running the chunks of one pass on the workers: dynamic assignment, lost workers, errors.

The workers are Ray actors or gradmap's worker processes; this module sees them through a
[`Transport`][] only (an index per worker, calls that return handles, a wait).

NOTE [a pass over the actors]:
    A call carries a batch of chunks, sized as in guided self-scheduling: the actor with room
    takes ``ceil(left / (GUIDED * actors))`` of the chunks left, so calls shrink to single chunks
    at the end, where they balance the actors' loads -- but at most twice as many as the actor
    had before in the pass, so that its first call (one chunk) starts at once, and at most what
    the transport allows for that actor (``Transport.most``: the caller, when it runs chunks
    itself, takes one at a time, and answers the workers between two). In the last ``END``
    chunks per actor every call takes one: with two calls in flight, a worker process held two
    to four chunks when the rest were gone, and the caller, done with its own, waited 5-11 ms of
    an 85 ms pass for them (message passing on molecules, 2 cores); one at a time, 0-2 ms
    (``tsum`` / ``tmap`` on processes, A/B in one process, medians of 11: molecules -1.5% / -2.5%,
    small bags -4% / -3%, trees -1%, ragged bags 0%). A batch does not end in
    the middle of a group of the sum (NOTE [chunk-order sum] in ``_join``) whose next chunk is
    next in the queue: a worker that runs a whole group adds its gradients up and sends them
    once. The caller, whose chunks are not sent anywhere, takes its free chunks from the end of
    the queue, so that it does not cut into the workers' groups. An actor call
    costs the driver about half a millisecond and the actor about as much (measured with Ray
    2.60), and the chunk plan's ~64 chunks are often a few milliseconds of work each: one call
    per chunk would spend a large part of the pass on calls. Batching changes no result: every
    chunk is still run and answered on its own (its gradient sum stays its own, for the
    fixed-order sum). Every actor has at most ``depth`` calls in flight (two: while it runs one,
    the next one's arguments are on their way). A chunk may be *owned* -- its graph lives on
    one actor, which alone can pull it back -- and then waits for that actor; otherwise any
    actor takes it.

    A call can end four ways:
    - a result: handed to ``on_result``;
    - :data:`~gradmap._remote._host.LOST` (the owner no longer holds the chunk: it was restarted
      after its process died): the chunk becomes a free *recompute* job;
    - a lost actor (its process died, or Ray cannot reach it; Ray restarts the actor, without the
      state it had): the chunk goes again, as a recompute for an owned chunk, to another actor;
      the actor's other owned chunks go the same way, since their graphs are gone (re-running
      more than needed is never wrong: a chunk's gradient comes from exactly one call). The lost
      actor gets no more work until a ping says it is back: while Ray restarts an actor, calls to
      it fail at once, and sending them would spend a chunk's attempts in milliseconds;
    - an exception raised by ``f`` or its backward: the loop's element's is raised (NOTE [the
      error of the loop's element]) -- unwrapped from Ray's ``RayTaskError``, as the same
      object ``f`` raised with its notes.
    A chunk that loses its actor more than ``max_attempts`` times fails with a ``RuntimeError``, so
    does a pass whose actors are all lost for ``restart_timeout`` seconds, and with ``timeout``
    set, a pass in which no call finishes for that long fails with a ``TimeoutError``: never a
    hang, never a wrong gradient. The driver waits in slices of a second, so ``KeyboardInterrupt``
    reaches it; queued calls are then cancelled.

    NOTE [a worker starting]: a worker process starts in the background and its first calls wait
    for it to import PyTorch (1.3-1.8 s on this 2-core machine when idle, more under load), so the
    pass's ``timeout`` does not count while a call is in flight to a worker that has answered
    nothing yet (for at most ``restart_timeout`` seconds into the pass): ``timeout=2`` timed out
    the first map after a stuck worker was replaced, the new worker's import counted as ``f``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import take_place
from ._host import LOST

__all__ = ["Job", "Transport", "WorkerLost", "run_pass"]

#: How a batch of chunks is run: ``(jobs, worker index, recompute) -> handle`` of a call whose
#: value is a list with one value per job.
Submit = Callable[[list["Job"], int, bool], Any]


class WorkerLost(Exception):
    """A call's worker died (or cannot be reached) before it answered."""


class Transport:
    """How the driver reaches its workers: what Ray and the local processes each implement.

    Attributes:
        name: the executor's name, for errors (``"ray"``, ``"processes"``).
        workers: the number of workers (indices ``0..workers-1``).
        depth: calls in flight per worker.
    """

    name = "remote"
    depth = 2

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def call(self, worker: int, method: str, *args: Any) -> Any:
        """Start ``method(*args)`` on a worker's host; return a handle of the call."""
        raise NotImplementedError

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        """The handles (some of ``handles``) whose calls have ended, waiting at most ``timeout``
        seconds for one."""
        raise NotImplementedError

    def get(self, handle: Any) -> Any:
        """An ended call's value; raises [`WorkerLost`][], or the exception the call raised (the
        worker's traceback as a note)."""
        raise NotImplementedError

    def cancel(self, handle: Any) -> None:
        """Forget a call (its value, if it comes, is dropped)."""

    def abandon(self, worker: int) -> None:
        """Stop a worker whose calls did not end in time (a pass's ``timeout``): its calls
        would hold up every later call to it. A worker that cannot be stopped is left."""

    def box(self, payload: bytes) -> Any:
        """What a call passes for a payload every chunk of a map shares (``f``)."""
        return payload

    def learn(self, f: Any, api: str, chunks: int, elements: int) -> None:
        """After a forward pass of ``chunks`` chunks of ``elements`` elements: what the transport
        measured of ``f``, for the next map to use."""

    def local(self, worker: int) -> bool:
        """Whether ``worker`` is the caller's own host (cotangents go to it as they are)."""
        return False

    def most(self, worker: int) -> int | None:
        """The most chunks one call to ``worker`` takes (``None``: as the pass decides)."""
        return None

    def starting(self, worker: int) -> bool:
        """Whether ``worker`` has not answered anything yet: a process still importing
        (NOTE [a worker starting])."""
        return False

    def release(self, call_id: str, workers: list[int] | None = None) -> None:
        """Tell the workers (``None``: every worker) to forget a map (fire and forget)."""


#: A call takes ``1 / (GUIDED * actors)`` of the chunks left.
GUIDED = 2

#: In a pass's last ``END * actors`` chunks, calls take one chunk each.
END = 4


class Job:
    """One chunk of a pass: ``owner`` is the actor holding its graph, or ``None`` (any actor;
    then ``recompute`` says whether the call is a recompute)."""

    __slots__ = ("attempts", "chunk", "owner", "recompute")

    def __init__(self, chunk: int, owner: int | None, recompute: bool = False) -> None:
        self.chunk = chunk
        self.owner = owner
        self.recompute = recompute
        self.attempts = 0


def run_pass(
    transport: Transport,
    jobs: Sequence[Job],
    submit: Submit,
    on_result: Callable[[int, int, Any], None],
    *,
    timeout: float | None = None,
    restart_timeout: float = 120.0,
    max_attempts: int = 3,
    describe: Callable[[int], str] = str,
    group: int = 1,
    last_wins: bool = False,
) -> None:
    """Run ``jobs`` on ``actors`` actors; see NOTE [a pass over the actors].

    NOTE [the error of the loop's element]:
        Where several elements fail, the loop raises the error of the one it runs first: in the
        forward the lowest element's, in a backward the highest's (the engine runs the nodes
        made last first, so the last element's backward comes first; within a chunk,
        ``_name_failing_element`` in ``_torch/_chunk`` takes them in that order too). So does
        a pass: a host marks the exception with the place of the failing chunk in its call
        (``mark_place``: the chunks after it in the call did not run, and go again), and once
        a chunk failed, the chunks on the far side of it (after it in the forward, before it in
        a backward, ``last_wins``) are no longer started, while the others still are, and the
        calls in flight finish: one of them may fail on the near side, whose error is then the
        loop's. (The caller's own host takes chunks from the end of the queue: its chunk could
        fail before the workers had started the lower ones.)

    Arguments:
        transport: the workers (the actors).
        jobs: the chunks to run, in the order to start them.
        submit: starts one call on a batch of jobs and returns its handle.
        on_result: called with ``(chunk, actor, value)`` for each chunk's result.
        timeout: seconds without any call finishing before the pass fails; ``None``: no limit.
        restart_timeout: seconds the pass may have no actor to run on before it fails.
        max_attempts: lost actors one chunk may meet before the pass fails.
        describe: names a chunk in errors.
        group: chunks per group of the sum (``ChunkPlan.group``).
        last_wins: a backward pass: the highest failing chunk's error is the loop's.

    Raises:
        The loop's element's exception (the lowest failing chunk's; the highest with
        ``last_wins``), or RuntimeError / TimeoutError.
    """
    actors, depth, name = transport.workers, transport.depth, transport.name
    owned: list[deque[Job]] = [deque() for _ in range(actors)]
    free: deque[Job] = deque()
    for first in jobs:
        (free if first.owner is None else owned[first.owner]).append(first)
    load = [0] * actors
    up = [True] * actors  # False from a loss until a ping answers
    probe_at: dict[int, float] = {}  # lost actors without a ping in flight: when to ping them
    inflight: dict[Any, tuple[list[Job] | None, int]] = {}  # a work call, or a ping (None)
    failures: dict[int, BaseException] = {}

    def requeue(job: Job) -> None:
        job.attempts += 1
        if job.attempts > max_attempts:
            failures.setdefault(
                job.chunk,
                RuntimeError(
                    f"gradmap: {describe(job.chunk)} lost its worker ({name}) {job.attempts} "
                    "times; giving up (why did the workers die: a crash in f, or too little "
                    "memory? Ray's logs say, for Ray)"
                ),
            )
        if job.owner is not None:
            job.owner, job.recompute = None, True
        free.append(job)

    def on_lost(actor: int) -> None:
        if up[actor]:
            up[actor] = False
            probe_at[actor] = time.monotonic()
        while owned[actor]:  # their graphs are gone with the actor
            job = owned[actor].popleft()
            job.owner, job.recompute = None, True
            free.append(job)

    sent = [0] * actors  # chunks sent to each actor in this pass
    most = [transport.most(a) for a in range(actors)]

    def take(queue: deque[Job], share: int, actor: int) -> list[Job]:
        # Guided, but at most twice what the actor had so far: its first call starts at once
        # (the driver pickles a forward's items as it sends them).
        size = max(1, min(-(-len(queue) // (GUIDED * share)), 2 * sent[actor]))
        if len(queue) <= END * share:
            size = 1
        limit = most[actor]
        if limit is not None:
            size = min(size, limit)
        if limit == 1 and queue is free:
            return [queue.pop()]  # the caller: from the end, not into the workers' groups
        batch = [queue.popleft()]
        # Consecutive chunks of one kind only (a batch is one call of one method), to the end
        # of the last one's group where the rest of it is next -- not in the pass's last
        # chunks, where single chunks balance the loads.
        whole = limit is None and len(queue) > GUIDED * share * group
        while queue and queue[0].recompute == batch[0].recompute:
            if len(batch) >= size and not (
                whole and queue[0].chunk // group == batch[-1].chunk // group
            ):
                break
            batch.append(queue.popleft())
        return batch

    def winner() -> int:
        return max(failures) if last_wins else min(failures)

    def beyond(job: Job, stop: int) -> bool:
        return job.chunk <= stop if last_wins else job.chunk >= stop

    def drop_beyond() -> None:
        # NOTE [the error of the loop's element]: no chunk on the far side of a failure starts.
        stop = winner()
        for queue in (free, *owned):
            if any(beyond(job, stop) for job in queue):
                kept = [job for job in queue if not beyond(job, stop)]
                queue.clear()
                queue.extend(kept)

    def fill() -> None:
        if failures:
            drop_beyond()
        progress = True
        while progress:
            progress = False
            share = max(1, sum(up))
            for a in range(actors):
                if not up[a] or load[a] >= depth:
                    continue
                if owned[a]:
                    batch = take(owned[a], 1, a)
                elif free:
                    batch = take(free, share, a)
                else:
                    continue
                sent[a] += len(batch)
                inflight[submit(batch, a, batch[0].recompute)] = (batch, a)
                load[a] += 1
                progress = True

    def working() -> int:
        return sum(load)

    try:
        last = down_since = started = time.monotonic()
        while True:
            now = time.monotonic()
            for a, when in list(probe_at.items()):
                if when <= now:
                    del probe_at[a]
                    inflight[transport.call(a, "pid")] = (None, a)
            if not working() or (
                now - started < restart_timeout
                and any(transport.starting(a) for _, a in inflight.values())
            ):
                last = now  # nothing in flight, or a worker still starting: no call is late
            fill()
            if not working() and not (free or any(owned)):
                break
            if any(up):
                down_since = now
            elif now - down_since > restart_timeout:
                raise RuntimeError(
                    f"gradmap: every worker ({name}) of this map was lost and none came back "
                    f"within {restart_timeout} s"
                )
            if timeout is not None and working() and now - last > timeout:
                raise TimeoutError(
                    f"gradmap: no chunk finished on the workers ({name}) in {timeout} s "
                    f"({working()} in flight); the workers running them are stopped (new ones "
                    "start at the next map)"
                )
            wait = 1.0 if not probe_at else max(0.0, min(1.0, min(probe_at.values()) - now))
            if not inflight:
                time.sleep(wait)
                continue
            ready = transport.wait(list(inflight), wait)
            for ref in ready:
                batch, actor = inflight.pop(ref)
                try:
                    values = transport.get(ref)
                except BaseException as exc:
                    if batch is None:  # a ping: not back yet
                        if not isinstance(exc, Exception):
                            raise
                        probe_at[actor] = time.monotonic() + _PING_INTERVAL
                        continue
                    load[actor] -= 1
                    if isinstance(exc, WorkerLost):
                        on_lost(actor)
                        for job in batch:
                            requeue(job)
                    elif isinstance(exc, Exception):
                        place = take_place(exc)
                        if place is None or not 0 <= place < len(batch):
                            place = 0
                        failures.setdefault(batch[place].chunk, exc)
                        # The chunks after it in the call did not run: they go again, if they
                        # are on the near side of the failure (NOTE [the error of the loop's
                        # element]).
                        for job in reversed(batch[place + 1 :]):
                            (free if job.owner is None else owned[job.owner]).appendleft(job)
                    else:
                        raise
                    continue
                if batch is None:
                    up[actor] = True
                    continue
                load[actor] -= 1
                last = time.monotonic()
                for job, value in zip(batch, values):
                    if isinstance(value, str) and value == LOST:
                        requeue(job)
                    else:
                        on_result(job.chunk, actor, value)
    except BaseException as exc:
        for ref in inflight:
            with contextlib.suppress(Exception):  # a call that cannot be cancelled runs out
                transport.cancel(ref)
        if isinstance(exc, TimeoutError):
            # The calls still in flight are stuck in ``f``: behind them, every later call to
            # their workers would wait too (later maps timed out or hung until ``f`` returned).
            for actor in sorted({a for _, a in inflight.values()}):
                with contextlib.suppress(Exception):
                    transport.abandon(actor)
        raise
    if failures:
        raise failures[winner()]


#: Seconds between pings of a lost actor.
_PING_INTERVAL = 0.2
