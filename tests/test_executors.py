"""Resolving the executor argument, and the thread budget."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import gradmap
from gradmap._executors import available_cores, resolve_executor


def test_default_is_shared_threads_on_all_cores():
    ex = resolve_executor(None, None)
    assert isinstance(ex, gradmap.ThreadExecutor)
    assert ex.workers == available_cores()
    assert resolve_executor("threads", 3).workers == 3


def test_serial_has_one_worker_and_reverse_backward():
    ex = resolve_executor("serial", None)
    assert ex.workers == 1 and ex.reverse_backward


def test_user_executor_workers_count_the_caller():
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        ex = resolve_executor(pool, None)
        assert isinstance(ex, gradmap.FuturesExecutor) and ex.workers == 4
        assert resolve_executor(pool, 2).workers == 2


def test_user_executor_is_not_shut_down():
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gradmap.tmap(lambda x: x * 2, torch.arange(6.0), executor=pool)
        assert pool.submit(lambda: 7).result() == 7


@pytest.mark.parametrize("bad", [1.5, "2", True])
def test_workers_type(bad):
    with pytest.raises(TypeError, match="workers must be an int"):
        resolve_executor(None, bad)


def test_bad_executor_type():
    with pytest.raises(TypeError, match="executor must be"):
        resolve_executor(42, None)


def test_caller_thread_settings_untouched_by_a_pool_map():
    before = torch.get_num_threads()
    seen = gradmap.tmap(lambda i: torch.get_num_threads(), range(8), workers=2, chunksize=1)
    assert torch.get_num_threads() == before
    assert set(seen) == {1}


def test_intra_op_threads_restored_after_map():
    before = torch.get_num_threads()
    gradmap.tmap(lambda x: x * 2, torch.arange(8.0), workers=2)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_intra_op_budget_inside_workers(executor):
    seen = gradmap.tmap(lambda i: torch.get_num_threads(), range(8), executor=executor, chunksize=1)
    # The serial reference runs as the caller's loop would; pools use one intra-op thread.
    assert set(seen) == ({torch.get_num_threads()} if executor == "serial" else {1})
