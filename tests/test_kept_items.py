"""Items kept from call to call on the process executor (``_remote/_kept.py``): a chunk whose
items are unchanged is not pickled again, and every change to them, by any route, is seen."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

import gradmap
from gradmap._remote import _kept
from gradmap._remote._kept import ItemsCache, items_cache
from gradmap._torch._native import native

import support


class Bag(NamedTuple):
    x: torch.Tensor
    scale: float


@pytest.fixture(scope="module")
def ex() -> Iterator[Any]:
    executor = gradmap.ProcessExecutor(workers=2, timeout=120)  # one worker and the caller
    try:
        with support.by_value(sys.modules[__name__]), support.maps_reach_workers():
            yield executor
    finally:
        executor.shutdown()


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    items_cache.clear()
    yield
    items_cache.clear()


def _bags(n: int = 12, seed: int = 0) -> list[Bag]:
    g = torch.Generator().manual_seed(seed)
    return [Bag(torch.randn(1 + i % 5, 3, generator=g), 0.5 + i) for i in range(n)]


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _loss(model: Any) -> Any:
    def f(bag: Bag) -> torch.Tensor:
        return model(bag.x).tanh().sum() * bag.scale

    return f


def _grads(model: torch.nn.Module, total: torch.Tensor) -> list[torch.Tensor]:
    return [g.clone() for g in torch.autograd.grad(total, list(model.parameters()))]


def _check(ex: Any, model: Any, bags: list[Any], api: str = "tsum") -> None:
    f = _loss(model)
    want = torch.stack([f(b) for b in bags]).sum()
    if api == "tsum":
        got = gradmap.tsum(f, bags, executor=ex)
    else:
        got = torch.stack(gradmap.tmap(f, bags, executor=ex)).sum()
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(model, got), _grads(model, want)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_unchanged_items_are_sent_as_kept(ex: Any, api: str) -> None:
    model, bags = _model(), _bags()
    _check(ex, model, bags, api)
    assert len(items_cache) > 0
    hits = items_cache.hits
    for _ in range(3):
        _check(ex, model, bags, api)
    assert items_cache.hits >= hits + 3 * len(items_cache)


@pytest.mark.parametrize(
    "change",
    ["in_place", "data", "numpy", "swap_data", "scalar", "negative_zero", "requires_grad"],
)
def test_every_change_to_the_items_is_seen(ex: Any, change: str) -> None:
    model, bags = _model(), _bags()
    _check(ex, model, bags)
    _check(ex, model, bags)  # kept now
    x = bags[3].x
    if change == "in_place":
        with torch.no_grad():
            x.mul_(-2)
    elif change == "data":
        x.data.add_(1.0)  # no version bump
    elif change == "numpy":
        x.numpy()[0, 0] = 123.0  # no version bump
    elif change == "swap_data":
        x.data = torch.full_like(x, 0.25)
    elif change == "scalar":
        bags[5] = Bag(bags[5].x, 7.0)  # a new tuple: new ids
    elif change == "negative_zero":
        bags = [Bag(b.x, 0.0) for b in bags]
        _check(ex, model, bags)
        _check(ex, model, bags)
        bags[2] = bags[2]._replace(scale=-0.0)
    else:
        x.requires_grad_()
    _check(ex, model, bags)
    if change == "requires_grad":
        f = _loss(model)
        (got,) = torch.autograd.grad(gradmap.tsum(f, bags, executor=ex), [x])
        (want,) = torch.autograd.grad(torch.stack([f(b) for b in bags]).sum(), [x])
        torch.testing.assert_close(got, want)


def test_f_writing_into_its_items_gets_fresh_copies(ex: Any) -> None:
    # In a worker, f writes into its copy of the items; the caller's items do not change, so
    # every call gives what the first gave (a kept copy that f wrote into is not reused).
    bags = _bags()

    def f(bag: Bag) -> torch.Tensor:
        out = bag.x.sum() * bag.scale
        with torch.no_grad():
            bag.x.add_(100.0)
        return out

    first = gradmap.tmap(f, bags, executor=ex)
    for _ in range(2):
        again = gradmap.tmap(f, bags, executor=ex)
        for a, b in zip(again, first):
            torch.testing.assert_close(a, b)


def test_other_items_are_pickled_every_call(ex: Any) -> None:
    # Lists and dicts may change without a trace: never kept, and changes are seen.
    model = _model()
    items = [[torch.randn(2, 3), 1.0] for _ in range(8)]

    def f(item: list[Any]) -> torch.Tensor:
        return model(item[0]).sum() * item[1]

    for step in range(3):
        items[1][1] = float(step)
        got = gradmap.tsum(f, items, executor=ex)
        torch.testing.assert_close(got, sum(f(i) for i in items))
    assert len(items_cache) == 0


def test_entries_go_with_their_items(ex: Any) -> None:
    model, bags = _model(), _bags()
    _check(ex, model, bags)
    assert len(items_cache) > 0
    del bags
    assert len(items_cache) == 0


def test_the_cache_keeps_at_most_its_budget() -> None:
    cache = ItemsCache(budget=3000)
    chunks = [[(torch.randn(100),)] for _ in range(5)]  # 400 bytes of data each
    for chunk in chunks:
        found = cache.lookup(chunk)[1]
        assert cache.keep(found, b"p" * 1000) is not None
    assert len(cache) == 3 and cache.size == 3000
    # The first two went first; the last three are found.
    assert cache.lookup(chunks[0])[0] is None
    assert all(cache.lookup(c)[0] is not None for c in chunks[2:])


@pytest.mark.parametrize(
    ("before", "after"),
    [(0.0, -0.0), (1, 1.0), (1, True), (2.0, float("nan")), ("a", "b"), ((1, 2), [1, 2])],
)
def test_a_chunk_found_by_ids_is_checked_value_by_value(before: Any, after: Any) -> None:
    # Ids are reused once objects die: what a chunk holds is compared, not only which objects.
    cache = ItemsCache()
    t = torch.ones(2)
    old, new = [(t, before)], [(t, after)]
    _, (_, atoms, tensors) = cache.lookup(old)
    ident = tuple(id(a) for args in new for a in args)
    assert cache.keep((ident, atoms, tensors), b"payload") is not None
    assert cache.lookup(new)[0] is None
    assert cache.lookup([(t, before)])[0] is None  # other ids: not found either


@pytest.mark.parametrize("how", ["native", "memcmp", "copy"])
def test_every_byte_of_a_kept_chunk_is_compared(monkeypatch: Any, how: str) -> None:
    """NOTE [kept items compared in place]: a change to any byte of any tensor of a kept chunk,
    made without a version bump, sends the chunk anew; put back, the chunk is found again --
    by the native module's comparison, by the C library's ``memcmp`` from Python, or by a copy."""
    if how == "native":
        if native() is None:
            pytest.skip("the native module is not built here")
    else:
        monkeypatch.setattr(_kept, "native", lambda: None)
    if how == "copy":
        monkeypatch.setattr(_kept, "_memcmp", None)
    cache = ItemsCache()
    chunk = [
        (torch.arange(6.0).reshape(2, 3), 1),
        (torch.arange(5, dtype=torch.int64), torch.ones(0)),
        (torch.tensor(3.5, dtype=torch.float64),),
    ]
    assert cache.keep(cache.lookup(chunk)[1], b"payload") is not None
    assert cache.lookup(chunk)[0] is not None
    for t in (chunk[0][0], chunk[1][0], chunk[2][0]):
        flat = t.data.view(-1)
        for i in (0, flat.numel() - 1):
            old = flat[i].item()
            flat[i] = old + 1  # (``.data``: no version bump)
            assert cache.lookup(chunk)[0] is None, (t, i)
            flat[i] = old
            assert cache.lookup(chunk)[0] is not None, (t, i)


@pytest.mark.parametrize("how", ["native", "memcmp"])
def test_a_kept_tensor_made_strided_in_place_is_not_taken_as_kept(
    monkeypatch: Any, how: str
) -> None:
    # Same shape and dtype, and the first bytes of its storage are the kept ones -- but the
    # tensor now steps over them: its values changed, and must not be taken for the kept ones.
    if how == "native" and native() is None:
        pytest.skip("the native module is not built here")
    if how != "native":
        monkeypatch.setattr(_kept, "native", lambda: None)
    cache = ItemsCache()
    t = torch.tensor([1.0, 2.0, 3.0])
    chunk = [(t,)]
    assert cache.keep(cache.lookup(chunk)[1], b"payload") is not None
    assert cache.lookup(chunk)[0] is not None
    storage = torch.tensor([1.0, 2.0, 3.0, 9.0, 9.0]).untyped_storage()
    with torch.no_grad():
        t.set_(storage, 0, (3,), (2,))
    assert t.tolist() == [1.0, 3.0, 9.0]
    assert cache.lookup(chunk)[0] is None


# -- NOTE [kept items cross to a worker process once] ---------------------------------------------


def test_kept_items_cross_to_a_worker_once(ex: Any) -> None:
    # One worker process runs every chunk: the second map over the same items sends their
    # keys, not their bytes (the items are ~200 KB; a map's other arguments a few KB). ``ex``
    # registers this module for pickling by value.
    alone = gradmap.ProcessExecutor(workers=1, caller_helps=False, timeout=120)
    model = _model()
    g = torch.Generator().manual_seed(1)
    bags = [Bag(torch.randn(200, 3, generator=g), 1.0) for _ in range(64)]
    worker = alone._pool().ensure(1)[0]
    sent = []
    for _ in range(3):
        before = worker.sent_bytes
        _check(alone, model, bags, "tmap")
        sent.append(worker.sent_bytes - before)
    items_bytes = sum(b.x.numel() * b.x.element_size() for b in bags)
    assert sent[0] > items_bytes
    # (The calls' own messages: ~15 KB here, over 64 chunks; the items again would be 150 KB.)
    assert sent[1] < items_bytes / 5 and sent[2] < items_bytes / 5
    kept = [entry.items.key for entry in items_cache._entries.values()]
    assert len(kept) == 64 and all(key in worker.held for key in kept)


def test_a_replaced_worker_is_sent_the_items_again(ex: Any) -> None:
    model, bags = _model(), _bags(40)
    _check(ex, model, bags)
    _check(ex, model, bags)  # kept, and held by the worker
    worker = ex._pool().ensure(1)[0]
    worker.process.kill()
    worker.process.wait()
    for _ in range(2):  # the first finds the worker gone (its chunks rerun), then a new one
        _check(ex, model, bags)
    _check(ex, model, bags, "tmap")


@pytest.mark.parametrize("seed", range(4))
def test_the_caller_s_account_keeps_step_with_the_worker(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    # Random sizes around a small budget: every key the account sends alone is held on the
    # other side (the worker's side is what unpickling the message does), with its payload.
    import pickle
    import random

    budget = 5000
    monkeypatch.setattr(_kept, "held_payloads", _kept.HeldPayloads(budget))
    account = _kept.PayloadAccount(budget)
    rng = random.Random(seed)
    pool = [
        _kept.KeptItems(k, bytes([k % 256]) * rng.choice([1, 400, 1500, 4000, 6000]))
        for k in range(12)
    ]
    refs = 0
    for _ in range(400):
        message = [account.wire(rng.choice(pool)) for _ in range(rng.randint(1, 4))]
        refs += sum(type(m).__name__ == "_HeldRef" for m in message)
        got = pickle.loads(pickle.dumps(message))
        for sent, items in zip(message, got):
            key = sent.key if hasattr(sent, "key") else sent.items.key
            assert items.key == key and items.payload == pool[key].payload
    assert refs > 100
    assert len(_kept.held_payloads) == len(account._held.entries)
