"""The pass over the actors (``_remote/_schedule.run_pass``) with a transport of its own: how
calls are sized. Every transport's behaviour is tested in ``test_remote.py``."""

from __future__ import annotations

from typing import Any

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
