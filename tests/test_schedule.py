"""The pass over the actors (``_remote/_schedule.run_pass``) with a transport of its own: how
calls are sized. Every transport's behaviour is tested in ``test_remote.py``."""

from __future__ import annotations

from typing import Any

import pytest

from gradmap._errors import mark_place, take_place
from gradmap._remote import _schedule
from gradmap._remote._schedule import Job, Transport, run_pass


class _Instant(Transport):
    """Two actors whose calls end as soon as the pass waits, oldest first."""

    name = "instant"

    def __init__(self) -> None:
        super().__init__(2)
        self.order: list[Any] = []

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        return [min(handles, key=self.order.index)]

    def get(self, handle: Any) -> Any:
        return handle.values


class _Handle:
    def __init__(self, values: list[str]) -> None:
        self.values = values


def test_the_last_chunks_of_a_pass_go_one_per_call():
    transport = _Instant()
    jobs = [Job(k, None) for k in range(64)]
    left = list(range(64))
    batches: list[tuple[int, int]] = []  # (chunks left before the call, its size)

    def submit(batch: list[Job], actor: int, recompute: bool) -> Any:
        batches.append((len(left), len(batch)))
        for job in batch:
            left.remove(job.chunk)
        handle = _Handle([f"chunk {job.chunk}" for job in batch])
        transport.order.append(handle)
        return handle

    got: dict[int, Any] = {}
    run_pass(transport, jobs, submit, lambda k, actor, value: got.setdefault(k, value))
    assert got == {k: f"chunk {k}" for k in range(64)}
    end = _schedule.END * transport.workers
    assert end >= 4  # (a rule that would send the end in batches again fails here)
    assert any(size > 1 for _, size in batches)  # guided before the end
    assert all(size == 1 for before, size in batches if before <= end), batches


class _Failing(Transport):
    """Actors whose calls end when the pass waits, ``first``'s before the others' (then oldest
    first); a chunk in ``bad`` raises, its exception marked with its place in the call as a host
    marks it. ``most``: actor 1 takes one chunk a call, from the end of the queue, as the
    caller's own host does."""

    name = "failing"

    def __init__(self, actors: int, bad: set[int], first: int, caller: bool) -> None:
        super().__init__(actors)
        self.bad, self.first, self.caller = bad, first, caller
        self.handles: list[_Call] = []
        self.run: list[int] = []  # the chunks run, in order

    def most(self, worker: int) -> int | None:
        return 1 if self.caller and worker == 1 else None

    def wait(self, handles: list[Any], timeout: float) -> list[Any]:
        return [min(handles, key=lambda h: (h.actor != self.first, self.handles.index(h)))]

    def get(self, handle: Any) -> Any:
        values = []
        for place, job in enumerate(handle.batch):
            self.run.append(job.chunk)
            if job.chunk in self.bad:
                exc = KeyError(job.chunk)
                mark_place(exc, place)
                raise exc
            values.append(job.chunk)
        return values


class _Call:
    def __init__(self, batch: list[Job], actor: int) -> None:
        self.batch, self.actor = batch, actor


def _failing_pass(transport: _Failing, count: int, last_wins: bool) -> int:
    def submit(batch: list[Job], actor: int, recompute: bool) -> Any:
        handle = _Call(batch, actor)
        transport.handles.append(handle)
        return handle

    jobs = [Job(k, None) for k in range(count)]
    with pytest.raises(KeyError) as info:
        run_pass(transport, jobs, submit, lambda k, actor, value: None, last_wins=last_wins)
    assert take_place(info.value) is None  # taken off by the pass
    return int(info.value.args[0])


def test_a_forward_raises_the_lowest_failing_chunks_error_though_a_later_failed_first():
    # NOTE [the error of the loop's element]: the caller's own host takes chunk 15 first, which
    # fails before the workers reached chunk 7; the pass raised chunk 15's error.
    transport = _Failing(2, bad={7, 15}, first=1, caller=True)
    assert _failing_pass(transport, 16, last_wins=False) == 7
    assert 7 in transport.run


def test_a_backward_raises_the_highest_failing_chunks_error_and_runs_what_a_failed_call_left():
    # Chunks 1 and 2 go in one call, which fails at chunk 1: chunk 2 did not run, and must (the
    # pass raised chunk 1's error); chunk 0 fails too, first, and is below both.
    transport = _Failing(1, bad={0, 1, 2}, first=0, caller=False)
    assert _failing_pass(transport, 16, last_wins=True) == 2
    assert transport.run.count(2) == 1
