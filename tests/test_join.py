"""The framework-free join bookkeeping (``_join``): the account of a join's outputs that
backwards freeing the graph went through (NOTE [a backward of some results])."""

from __future__ import annotations

import pytest

from gradmap._join import BACKWARD_TWICE, Spent


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
