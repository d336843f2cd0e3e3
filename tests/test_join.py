"""The framework-free join bookkeeping (``_join``): the account of a join's outputs that
backwards freeing the graph went through (NOTE [a backward of some results]), and the fixed-order
sum of the chunks' gradients (NOTE [chunk-order sum])."""

from __future__ import annotations

import random
import threading

import pytest

from gradmap._join import BACKWARD_TWICE, OrderedSum, Spent, fold_pairs, sum_by_position
from gradmap._plan import GROUPS, MAX_GROUP, plan_chunks


def test_one_backward_of_every_output_spends_all_then_refuses_any():
    spent = Spent(3)
    spent.spend(["g", "g", "g"])
    assert spent.left == 0 and spent.spent(0, 3)
    spent.spend([None, None, None])  # no cotangent: nothing goes through
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        spent.spend([None, "g", None])


def test_outputs_spent_a_few_at_a_time():
    spent = Spent(5)
    spent.spend([None, "g", None, None, None])
    assert spent.left == 4
    assert spent.spent(1, 2) and not spent.spent(0, 2)
    spent.spend(["g", None, None, None, "g"])
    assert spent.spent(0, 2) and not spent.spent(2, 5)
    with pytest.raises(RuntimeError) as info:
        spent.spend([None, None, "g", None, "g"])  # output 4 again: nothing is marked
    assert str(info.value) == BACKWARD_TWICE
    assert spent.left == 2 and not spent.spent(2, 3)
    spent.spend([None, None, "g", "g", None])
    assert spent.left == 0 and spent.spent(0, 5)


def test_a_backward_that_keeps_the_graph_marks_nothing_but_is_refused_what_is_spent():
    spent = Spent(3)
    spent.spend(["g", None, None], free=False)
    assert spent.left == 3 and not spent.spent(0, 1)
    spent.spend([None, "g", None])
    with pytest.raises(RuntimeError, match="a second time"):
        spent.spend([None, "g", "g"], free=False)  # retain_graph=True after the graph went
    spent.spend(["g", None, "g"], free=False)
    assert spent.left == 2
    spent.spend(["g", None, "g"])
    with pytest.raises(RuntimeError, match="a second time"):
        spent.spend(["g", None, None], free=False)


# -- the fixed-order sum ------------------------------------------------------------------------


def _trace(a: str, b: str) -> str:
    return f"({a}+{b})"  # an "addition" that shows its order


def test_groups_of_the_sum_depend_on_the_chunk_count_only():
    assert plan_chunks(31, chunksize=1).group == 1  # fewer than 2 * GROUPS chunks
    assert plan_chunks(64, chunksize=1).group == 64 // GROUPS
    assert plan_chunks(10_000, chunksize=1).group == MAX_GROUP
    assert plan_chunks(256).group == plan_chunks(256).count // GROUPS


def test_sum_adds_each_group_in_chunk_order_then_the_groups():
    # three chunks reach input 0, in groups (0, 0, 1); chunk 1 reaches input 1 only
    positions = [[0], [1, 0], [0]]
    per_chunk = [["a"], ["x", "b"], ["c"]]
    got = sum_by_position(2, positions, per_chunk, _trace, groups=[0, 0, 1])
    assert got == ["((a+b)+c)", "x"]
    got = sum_by_position(2, positions, per_chunk, _trace, groups=[0, 1, 1])
    assert got == ["(a+(b+c))", "x"]
    assert sum_by_position(2, positions, per_chunk, _trace) == ["((a+b)+c)", "x"]
    assert sum_by_position(2, [[0], [0]], [None, ["a"]], _trace, groups=[0, 0]) == ["a", None]


def test_a_group_added_up_by_a_worker_gives_the_drivers_sum():
    # Any assignment of groups to workers that add them up (``fold_pairs``) gives what the
    # driver gives adding every chunk itself: the same terms in the same order.
    rng = random.Random(0)
    chunks, group, keys = 12, 4, ["p", "q", "r"]
    pairs = [[(key, f"{key}{k}") for key in keys if rng.random() < 0.7] for k in range(chunks)]
    index = {key: i for i, key in enumerate(keys)}

    def driver(per_chunk: dict[int, list[tuple[str, str]]]) -> list[str | None]:
        order = sorted(per_chunk)
        return sum_by_position(
            len(keys),
            [[index[key] for key, _ in per_chunk[k]] for k in order],
            [[g for _, g in per_chunk[k]] for k in order],
            _trace,
            [k // group for k in order],
        )

    want = driver(dict(enumerate(pairs)))
    for folded in ([0], [1, 2], [0, 1, 2]):
        per_chunk = dict(enumerate(pairs))
        for g in folded:
            members = range(g * group, (g + 1) * group)
            per_chunk[members[0]] = fold_pairs([pairs[k] for k in members], _trace)
            for k in members[1:]:
                per_chunk[k] = []
        assert driver(per_chunk) == want
    # and not the plain left fold over all chunks: a change of order would show
    assert want != sum_by_position(
        len(keys),
        [[index[key] for key, _ in p] for p in pairs],
        [[g for _, g in p] for p in pairs],
        _trace,
    )


@pytest.mark.parametrize("group", [1, 2, 3])
def test_gradients_added_as_they_come_give_the_sum_of_every_chunk(group):
    """``OrderedSum`` (NOTE [gradients added as they come]): chunks put in any order, from
    several threads at once, give ``sum_by_position``'s terms in its order; and a chunk waits
    only while one before it has not come."""
    rng = random.Random(group)
    chunks, keys = 11, ["p", "q", "r"]
    pairs = [[(key, f"{key}{k}") for key in keys if rng.random() < 0.7] for k in range(chunks)]
    pairs[4] = None  # a chunk that did no backward work
    index = {key: i for i, key in enumerate(keys)}
    want = sum_by_position(
        len(keys),
        [[index[key] for key, _ in p or ()] for p in pairs],
        [[g for _, g in p] if p is not None else None for p in pairs],
        _trace,
        [k // group for k in range(chunks)],
    )

    def got(summed: OrderedSum[str, str]) -> list[str | None]:
        by_key = summed.result()
        return [by_key.get(key) for key in keys]

    for order in (
        list(range(chunks)),
        list(reversed(range(chunks))),
        rng.sample(range(chunks), chunks),
    ):
        summed: OrderedSum[str, str] = OrderedSum(chunks, _trace, group)
        for k in order:
            summed.put(k, pairs[k])
        assert got(summed) == want, order
    summed = OrderedSum(chunks, _trace, group)
    waiting = []
    for k in range(chunks):  # in order: none waits
        summed.put(k, pairs[k])
        waiting.append(len(summed._waiting))
    assert waiting == [0] * chunks
    summed = OrderedSum(chunks, _trace, group)
    start = threading.Barrier(4)

    def put(ks: list[int]) -> None:
        start.wait()
        for k in ks:
            summed.put(k, pairs[k])

    threads = [threading.Thread(target=put, args=(list(range(i, chunks, 4)),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got(summed) == want
