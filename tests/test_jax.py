"""gradmap.jax.tmap against the plain loop: values, gradients, transformations, errors."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import traceback
import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import gradmap.jax as gmj  # noqa: E402
from gradmap._jax import _compiled  # noqa: E402

from support import Boom, notes  # noqa: E402


@pytest.fixture
def kw(tmap_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``gmj.tmap`` selecting an executor: conftest.py's ``tmap_kwargs``
    (every executor, small chunks, so that small maps still have several)."""
    return tmap_kwargs


def loop(f: Any, *iterables: Any, **_: Any) -> list[Any]:
    """The plain loop that ``tmap`` replaces (arrays iterated over their first dimension)."""
    return list(map(f, *iterables))


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def bags(n: int = 7, seed: int = 0) -> list[jax.Array]:
    """Ragged items: bags of 1..4 rows of 3 features (few shapes, few compilations)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((1 + i % 4, 3)), jnp.float32) for i in range(n)]


def params(seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(2), jnp.float32),
    }


def bag_loss(p: dict[str, jax.Array], bag: jax.Array) -> jax.Array:
    return jnp.tanh(bag @ p["w"] + p["b"]).mean() ** 2


bag_loss_jit = jax.jit(bag_loss)


# --------------------------------------------------------------------------------------------
# The semantics of map, eagerly


def test_results_equal_builtin_map(kw):
    xs = bags()
    out = gmj.tmap(lambda x: (x * 2).sum(axis=0), xs, **kw)
    assert isinstance(out, list)
    assert_trees_close(out, loop(lambda x: (x * 2).sum(axis=0), xs))


class Pair(NamedTuple):
    a: Any
    b: Any


def test_pytrees_in_and_out_with_other_objects(kw):
    items = [{"x": x, "tag": f"t{i}", "k": i} for i, x in enumerate(bags(5))]

    def f(item: dict[str, Any]) -> Any:
        return Pair(item["x"].sum() * item["k"], [item["tag"], item["x"].shape])

    out = gmj.tmap(f, items, **kw)
    expected = loop(f, items)
    assert [o.b for o in out] == [e.b for e in expected]
    assert_trees_close([o.a for o in out], [e.a for e in expected])


def test_several_iterables_stop_at_shortest_and_strict(kw):
    xs, ys = bags(5), list(range(3))
    out = gmj.tmap(lambda x, y: x.sum() * y, xs, ys, **kw)
    assert len(out) == 3
    assert_trees_close(out, loop(lambda x, y: x.sum() * y, xs, ys))
    with pytest.raises(ValueError, match="different lengths"):
        gmj.tmap(lambda x, y: x, xs, ys, strict=True, **kw)


def test_arrays_are_mapped_over_their_first_dimension(kw):
    xs = jnp.arange(12.0).reshape(4, 3)
    out = gmj.tmap(lambda row: row * 2, xs, **kw)
    assert_trees_close(out, [row * 2 for row in np.asarray(xs)])
    with pytest.raises(TypeError, match="0-d array"):
        gmj.tmap(lambda x: x, jnp.float32(1.0), **kw)


def test_generators_empty_and_bad_arguments(kw):
    assert gmj.tmap(lambda x: x * 2, (i for i in range(5)), **kw) == [0, 2, 4, 6, 8]
    assert gmj.tmap(lambda x: x, [], **kw) == []
    with pytest.raises(TypeError, match="callable"):
        gmj.tmap(3, [1], **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="at least one iterable"):
        gmj.tmap(lambda x: x)


def test_elements_run_concurrently_on_threads():
    barrier = threading.Barrier(2, timeout=10)

    def f(x: jax.Array) -> jax.Array:
        barrier.wait()  # passes only if two elements are in f at the same time
        return x + 1

    out = gmj.tmap(f, [jnp.zeros(2), jnp.ones(2)], workers=2, chunksize=1)
    assert_trees_close(out, [jnp.ones(2), 2 * jnp.ones(2)])


def test_thread_local_config_reaches_workers(kw):
    if hasattr(jax, "enable_x64"):
        enable_x64 = jax.enable_x64
    else:  # JAX before 0.8
        from jax.experimental import enable_x64
    with enable_x64(True):
        dtypes = gmj.tmap(lambda i: jnp.asarray(1.0).dtype, range(4), **kw)
    assert all(d == jnp.float64 for d in dtypes)
    dtypes = gmj.tmap(lambda i: jnp.asarray(1.0).dtype, range(4), **kw)
    assert all(d == jnp.float32 for d in dtypes)


def test_nested_tmap(kw):
    xs = bags(4)
    out = gmj.tmap(lambda x: sum(gmj.tmap(lambda r: r.sum(), x, **kw)), xs, **kw)
    assert_trees_close(out, [x.sum() for x in xs], rtol=1e-5)


# --------------------------------------------------------------------------------------------
# Reverse mode: the loop's gradients, to closed-over arrays and to items


def total_loss(tm: Any, f: Any, p: Any, xs: Any, **kw: Any) -> jax.Array:
    return jnp.stack(tm(lambda x: f(p, x), xs, **kw)).sum()


@pytest.mark.parametrize("f", [bag_loss, bag_loss_jit], ids=["general", "jitted"])
def test_grad_to_closed_over_params(kw, f):
    p, xs = params(), bags()
    got = jax.grad(lambda p: total_loss(gmj.tmap, f, p, xs, **kw))(p)
    expected = jax.grad(lambda p: total_loss(loop, f, p, xs))(p)
    assert_trees_close(got, expected)


@pytest.mark.parametrize("f", [bag_loss, bag_loss_jit], ids=["general", "jitted"])
def test_value_and_grad_and_vjp_to_items_and_params(kw, f):
    p, xs = params(), bags()

    def total(p: Any, xs: Any, tm: Any) -> jax.Array:
        return total_loss(tm, f, p, xs, **(kw if tm is gmj.tmap else {}))

    got = jax.value_and_grad(total, argnums=(0, 1))(p, xs, gmj.tmap)
    expected = jax.value_and_grad(total, argnums=(0, 1))(p, xs, loop)
    assert_trees_close(got, expected)

    out, pullback = jax.vjp(lambda p, xs: gmj.tmap(lambda x: f(p, x), xs, **kw), p, xs)
    out_l, pullback_l = jax.vjp(lambda p, xs: loop(lambda x: f(p, x), xs), p, xs)
    assert_trees_close(out, out_l)
    cts = [jnp.float32(i - 2.5) for i in range(len(xs))]
    assert_trees_close(pullback(cts), pullback_l(cts))


def test_grad_to_a_stacked_array_iterable(kw):
    p = params()
    xs = jnp.asarray(np.random.default_rng(2).standard_normal((5, 2, 3)), jnp.float32)
    got = jax.grad(lambda xs: total_loss(gmj.tmap, bag_loss_jit, p, xs, **kw))(xs)
    expected = jax.grad(lambda xs: total_loss(loop, bag_loss_jit, p, xs))(xs)
    assert_trees_close(got, expected)


def test_check_grads_numerically(kw):
    p, xs = params(), bags(5)
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)

    def total(w: jax.Array, b: jax.Array) -> jax.Array:
        return total_loss(gmj.tmap, bag_loss, {"w": w, "b": b}, xs, **kw)

    check_grads(total, (p["w"], p["b"]), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_outputs_of_every_kind(kw):
    xs = bags(5)

    def make_f(p: Any) -> Any:
        def f(x: jax.Array) -> dict[str, Any]:
            y = x @ p["w"]
            return {
                "used": (y**2).sum(),
                "unused": jnp.sin(y).sum(),  # gets a symbolic zero cotangent
                "int": jnp.argmax(y.sum(axis=0)),  # integer: no tangent
                "w": p["w"],  # a closed-over tracer returned as it is
                "item": x,  # a concrete item returned as it is
                "text": "ok",
            }

        return f

    def total(p: Any, tm: Any) -> tuple[jax.Array, list[int]]:
        outs = tm(make_f(p), xs, **(kw if tm is gmj.tmap else {}))
        assert [o["text"] for o in outs] == ["ok"] * len(xs)
        assert_trees_close([o["item"] for o in outs], xs)
        return sum(o["used"] + 0.5 * o["w"].sum() for o in outs), [int(o["int"]) for o in outs]

    p = params()
    (value, ints), grads = jax.value_and_grad(total, has_aux=True)(p, gmj.tmap)
    (value_l, ints_l), grads_l = jax.value_and_grad(total, has_aux=True)(p, loop)
    assert ints == ints_l
    assert_trees_close((value, grads), (value_l, grads_l))


def test_a_parameter_used_twice_in_one_jitted_call(kw):
    xs = bags(5)
    f = jax.jit(lambda a, b, x: (x @ a * b.sum(axis=0)).sum())
    w = params()["w"]
    got = jax.grad(lambda w: sum(gmj.tmap(lambda x: f(w, w, x), xs, **kw)))(w)
    expected = jax.grad(lambda w: sum(loop(lambda x: f(w, w, x), xs)))(w)
    assert_trees_close(got, expected)


def test_elements_that_do_not_use_the_params(kw):
    p, xs = params(), bags(6)

    def total(p: Any, tm: Any) -> jax.Array:
        def f(i: int, x: jax.Array) -> jax.Array:
            return bag_loss_jit(p, x) if i % 2 else x.sum()

        return sum(tm(f, range(6), xs, **(kw if tm is gmj.tmap else {})))

    assert_trees_close(jax.value_and_grad(total)(p, gmj.tmap), jax.value_and_grad(total)(p, loop))


def test_parameter_gradients_are_bitwise_the_same_for_any_workers():
    p, xs = params(), bags(16)
    grads = [
        jax.grad(lambda p, w=w: total_loss(gmj.tmap, bag_loss_jit, p, xs, workers=w, chunksize=3))(
            p
        )
        for w in (1, 2, 4)
    ]
    grads.append(
        jax.grad(
            lambda p: total_loss(gmj.tmap, bag_loss_jit, p, xs, executor="serial", chunksize=3)
        )(p)
    )
    for g in grads[1:]:
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grads[0])):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_compiled_pullbacks_are_cached_and_released():
    xs = bags(8)
    held = {"f": jax.jit(lambda w, x: (x @ w).sum())}
    w = params()["w"]

    def total(w: jax.Array) -> jax.Array:
        f = held["f"]
        return sum(gmj.tmap(lambda x: f(w, x), xs))

    before = len(_compiled._cache)
    jax.grad(total)(w)
    count = len(_compiled._cache)
    assert count >= before + 4  # one entry per shape of bag
    jax.grad(total)(w)
    assert len(_compiled._cache) == count  # the second call reused them
    held.clear()
    gc.collect()
    assert len(_compiled._cache) < count  # entries live as long as the jitted function


def test_one_trace_per_signature():
    p = params()
    xs = [jnp.ones((1 + i % 2, 3)) * i for i in range(8)]  # two shapes
    calls = []

    def f(x: jax.Array, scale: float) -> jax.Array:
        calls.append(x.shape)
        return bag_loss(p, x) * scale

    def total(p_: Any) -> jax.Array:
        nonlocal p
        p = p_
        return sum(gmj.tmap(f, xs, [1.0] * 4 + [2.0] * 4, executor="serial", chunksize=3))

    jax.grad(total)(params())
    assert len(calls) == 4  # (2 shapes) x (2 values of the Python scalar)


def test_python_scalars_are_constants_and_items_may_be_read(kw):
    p, xs = params(), bags(6)
    scales = [0.5, -0.0, 0.0, 2.0, 1.0, -1.5]
    lengths = jnp.asarray([1, 2, 1, 3, 2, 1])  # read as Python ints inside f
    offsets = [np.full(2, i, np.float32) for i in range(6)]  # numpy items, numpy applied to them

    def total(p: Any, tm: Any) -> jax.Array:
        def f(x: jax.Array, s: float, n: jax.Array, o: np.ndarray) -> jax.Array:
            return (bag_loss(p, x[: int(n)]) + np.sum(o)) * s

        return sum(tm(f, xs, scales, lengths, offsets, **(kw if tm is gmj.tmap else {})))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # items read with int(): traced one by one, no loop
        got = jax.value_and_grad(total)(p, gmj.tmap)
    assert_trees_close(got, jax.value_and_grad(total)(p, loop))


def test_numpy_items_share_a_trace():
    p = params()
    xs = [np.full((2, 3), i, np.float32) for i in range(6)]
    calls = []

    def total(p: Any) -> jax.Array:
        def f(x: np.ndarray) -> jax.Array:
            calls.append(1)
            return bag_loss(p, x)

        return sum(gmj.tmap(f, xs, executor="serial"))

    got = jax.grad(total)(p)
    assert len(calls) == 1
    assert_trees_close(got, jax.grad(lambda p: sum(bag_loss(p, x) for x in xs))(p))


def test_branch_on_an_array_value_runs_the_loop_with_a_warning(kw):
    p, xs = params(), bags(5)

    def f(p: Any, x: jax.Array) -> jax.Array:
        if x.sum() > 0:  # a branch on a concrete item's value: fine in the loop, not traced
            return bag_loss(p, x)
        return -bag_loss(p, x)

    with pytest.warns(RuntimeWarning, match="could not be traced"):
        got = jax.grad(lambda p: total_loss(gmj.tmap, f, p, xs, **kw))(p)
    assert_trees_close(got, jax.grad(lambda p: total_loss(loop, f, p, xs))(p))


def _x64() -> Any:
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64(True)


def test_a_numpy_float_and_a_python_float_are_not_one_trace():
    """``np.float64(0.1)`` is a ``float`` too, but strongly typed: float32 times it is float64,
    times a Python 0.1 float32. As an item or closed over, each gets its own trace (they shared
    one, and the second came out in the first's dtype)."""
    with _x64():
        w = jnp.array([1.0, 2.0, 3.0], dtype=jnp.float32)
        scales = [0.1, np.float64(0.1)]
        got = jax.vjp(lambda w: gmj.tmap(lambda s: w * s / 3, scales, executor="serial"), w)[0]
        assert [y.dtype for y in got] == [jnp.float32, jnp.float64]

        def closed_over(s: float) -> Any:
            return jax.vjp(lambda w: gmj.tmap(lambda x: w * s * x, (1, 2), executor="serial"), w)

        assert closed_over(0.1)[0][0].dtype == jnp.float32
        assert closed_over(np.float64(0.1))[0][0].dtype == jnp.float64


_MASK = np.array([True, False, True, True])
_N = jnp.array(2)


@pytest.mark.parametrize("case", ["mask", "slice", "shape", "shape-item"], ids=lambda c: c)
def test_static_uses_of_concrete_arrays_run_the_loop(kw, case):
    """A boolean mask, a slice bound, a shape that ``f`` takes from a concrete array (closed
    over, or an item): the loop runs them; traced, JAX refuses them (not all as a
    ConcretizationTypeError). Those elements run as in the loop."""
    xs = [jnp.arange(4.0) + i for i in range(3)]
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    ks: list[Any] = [jnp.array(k) for k in (1, 3, 2)] if case == "shape-item" else [None] * 3
    f = {
        "mask": lambda w, x, k: (x[_MASK] * w[_MASK]).sum(),
        "slice": lambda w, x, k: (x[:_N] * w[:_N]).sum(),
        "shape": lambda w, x, k: (jnp.zeros(_N) + x[:2] * w[:2]).sum(),
        "shape-item": lambda w, x, k: (jnp.zeros(k) + x[:k] * w[:k]).sum(),
    }[case]
    want = jax.grad(lambda w: sum(f(w, x, k) for x, k in zip(xs, ks)))(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the loop's warning)
        got = jax.grad(lambda w: gmj.tsum(lambda x, k: f(w, x, k), xs, ks, **kw))(w)
        got_map = jax.grad(lambda w: sum(gmj.tmap(lambda x, k: f(w, x, k), xs, ks, **kw)))(w)
    assert_trees_close(got, want)
    assert_trees_close(got_map, want)


def test_numpy_text_and_object_arrays_are_used_as_they_are(kw):
    """Arrays of strings or objects have no JAX type: closed over or in the items, f gets them
    as they are (tracing them crashed), and a change to their text is seen."""
    labels = np.array(["a", "b", "a", "c"])
    xs = [jnp.arange(4.0) + i for i in range(3)]
    tags = [np.array(["x", "y"]), np.array(["y", "y"]), np.array(["x", "x"])]
    w = jnp.array([1.0, 2.0, 3.0, 4.0])

    def f(w: jax.Array, x: jax.Array, t: np.ndarray) -> jax.Array:
        return (x * w * (labels == "a")).sum() * float((t == "x").sum() + 1)

    for _ in range(2):
        want = jax.grad(lambda w: sum(f(w, x, t) for x, t in zip(xs, tags)))(w)
        got = jax.grad(lambda w: gmj.tsum(lambda x, t: f(w, x, t), xs, tags, **kw))(w)
        assert_trees_close(got, want)
        labels[1] = "a"  # seen by the next call


def test_items_and_closures_that_differ_in_the_sign_of_zero_are_not_one_trace():
    """-0.0 == 0.0, but w / -0.0 is -inf: a numpy float32 item and a complex closure value of
    each sign get traces of their own (they shared one, keyed by ``==``)."""
    w = jnp.asarray(1.0, jnp.float32)
    scales = [np.float32(0.0), np.float32(-0.0)]
    got = jax.vjp(lambda w: gmj.tmap(lambda s: w / s, scales, executor="serial"), w)[0]
    assert [float(y) for y in got] == [np.inf, -np.inf]
    with _x64():
        v = jnp.asarray(1.0)

        def angle_sum(c: complex) -> float:
            return float(gmj.tsum(lambda x: jnp.angle(c) * v * x, [1.0, 1.0], executor="serial"))

        assert angle_sum(complex(0.0, 0.0)) == 0.0
        assert angle_sum(complex(-0.0, 0.0)) == pytest.approx(2 * np.pi)


def test_tsum_of_half_precision_losses_scaled_by_the_caller(kw):
    """Loss scaling: the caller multiplies the sum by 4096 (or divides it). Computed in float16,
    an element's gradient taken with cotangent one underflows (or overflows) before the scale,
    where the loop's backward carries the scaled cotangent: such elements keep their pullback,
    the loop's gradients."""
    with _x64():
        w = jnp.array(1.0, dtype=jnp.float16)
        small = [jnp.array(1e-4, dtype=jnp.float16), jnp.array(2e-4, dtype=jnp.float16)]
        large = [jnp.array(300.0, dtype=jnp.float16), jnp.array(260.0, dtype=jnp.float16)]

        def f(w: jax.Array, x: jax.Array) -> jax.Array:
            return w * x * x

        def both(xs: list[jax.Array], scale: float) -> tuple[float, float]:
            want = jax.grad(lambda w: sum(f(w, x) for x in xs) * scale)(w)
            got = jax.grad(lambda w: gmj.tsum(lambda x: f(w, x), xs, **kw) * scale)(w)
            return float(got), float(want)

        got, want = both(small, 4096.0)
        assert got == want
        got, want = both(large, 1 / 1000.0)
        assert got == want
        # float32 parameters, float16 inside f, a float32 loss
        w32 = jnp.ones(2, jnp.float32)

        def mixed(w: jax.Array, x: jax.Array) -> jax.Array:
            return jnp.sum(w.astype(jnp.float16) * x * x).astype(jnp.float32)

        want = jax.grad(lambda w: sum(mixed(w, x) for x in small) * 4096.0)(w32)
        got = jax.grad(lambda w: gmj.tsum(lambda x: mixed(w, x), small, **kw) * 4096.0)(w32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_jacrev_calls_the_pullbacks_under_vmap(kw):
    p, xs = params(), bags(5)
    got = jax.jacrev(lambda p: jnp.stack(gmj.tmap(lambda x: bag_loss_jit(p, x), xs, **kw)))(p)
    expected = jax.jacrev(lambda p: jnp.stack(loop(lambda x: bag_loss_jit(p, x), xs)))(p)
    assert_trees_close(got, expected)


# --------------------------------------------------------------------------------------------
# Other transformations: the plain loop, composing as it does (whatever the executor)

ONE_EXECUTOR = {"executor": "threads", "chunksize": 2}


def test_under_jit_the_map_is_the_traced_loop():
    kw = ONE_EXECUTOR
    p, xs = params(), bags()

    @jax.jit
    def step(p: Any, xs: Any) -> Any:
        return jax.value_and_grad(lambda p: total_loss(gmj.tmap, bag_loss, p, xs, **kw))(p)

    expected = jax.value_and_grad(lambda p: total_loss(loop, bag_loss, p, xs))(p)
    assert_trees_close(step(p, xs), expected)
    # jit inside grad, and grad inside jit of a jitted f
    got = jax.grad(jax.jit(lambda p: total_loss(gmj.tmap, bag_loss_jit, p, xs, **kw)))(p)
    assert_trees_close(got, expected[1])


def test_second_order_hessian_and_grad_of_grad():
    kw = ONE_EXECUTOR
    xs = bags(4)
    w = jnp.asarray([0.3, -0.2, 0.5], jnp.float32)

    def total(w: jax.Array, tm: Any) -> jax.Array:
        return sum(
            tm(lambda x: jnp.sin(x @ w).sum() * (w**2).sum(), xs, **(kw if tm is gmj.tmap else {}))
        )

    assert_trees_close(jax.hessian(total)(w, gmj.tmap), jax.hessian(total)(w, loop), rtol=1e-4)
    ggrad = jax.grad(lambda w, tm: jax.grad(total)(w, tm).sum())
    assert_trees_close(ggrad(w, gmj.tmap), ggrad(w, loop), rtol=1e-4)
    check_grads(lambda w: total(w, gmj.tmap), (w,), order=2, modes=("rev",), atol=5e-2, rtol=5e-2)


def test_vmap_jvp_and_linearize():
    kw = ONE_EXECUTOR
    xs = bags(4)
    ws = jnp.asarray(np.random.default_rng(3).standard_normal((3, 3)), jnp.float32)

    def total(w: jax.Array, tm: Any) -> jax.Array:
        return sum(tm(lambda x: jnp.tanh(x @ w).sum(), xs, **(kw if tm is gmj.tmap else {})))

    assert_trees_close(
        jax.vmap(total, (0, None))(ws, gmj.tmap), jax.vmap(total, (0, None))(ws, loop)
    )
    t = jnp.ones(3)
    assert_trees_close(
        jax.jvp(lambda w: total(w, gmj.tmap), (ws[0],), (t,)),
        jax.jvp(lambda w: total(w, loop), (ws[0],), (t,)),
    )
    _, lin = jax.linearize(lambda w: total(w, gmj.tmap), ws[0])
    _, lin_l = jax.linearize(lambda w: total(w, loop), ws[0])
    assert_trees_close(lin(t), lin_l(t))


# --------------------------------------------------------------------------------------------
# Errors name the element


@pytest.mark.parametrize("bad", [0, 5])
def test_forward_error_names_the_element(kw, bad):
    def f(i: int) -> jax.Array:
        if i == bad:
            raise Boom(f"bad element {i}")
        return jnp.float32(i)

    with pytest.raises(Boom, match=f"bad element {bad}") as info:
        gmj.tmap(f, range(8), **kw)
    assert f"element {bad} (of 8)" in notes(info.value)
    assert "f" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]


@pytest.mark.parametrize("where", ["grad", "jit"])
def test_forward_error_under_transformations(kw, where):
    w = jnp.ones(3)

    def total(w: jax.Array) -> jax.Array:
        def f(i: int) -> jax.Array:
            if i == 3:
                raise Boom("three")
            return (w * i).sum()

        return sum(gmj.tmap(f, range(6), **kw))

    run = jax.grad(total) if where == "grad" else jax.jit(total)
    with pytest.raises(Boom) as info:
        run(w)
    assert "forward pass of element 3 (of 6)" in notes(info.value)


@jax.custom_vjp
def _fragile(x: jax.Array) -> jax.Array:
    return x * 2


def _fragile_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x * 2, x


def _fragile_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    if x.shape[0] == 3:  # the element whose bag has 3 rows
        raise Boom("no gradient for 3 rows")
    return (2 * g,)


_fragile.defvjp(_fragile_fwd, _fragile_bwd)


@pytest.mark.parametrize("jit", [False, True], ids=["general", "jitted"])
def test_backward_error_names_the_element(kw, jit):
    xs = bags(6)  # element 2 has 3 rows
    f = (
        jax.jit(lambda w, x: (_fragile(x) @ w).sum())
        if jit
        else (lambda w, x: (_fragile(x) @ w).sum())
    )
    w = params()["w"]
    with pytest.raises(Boom, match="3 rows") as info:
        jax.grad(lambda w, xs: sum(gmj.tmap(lambda x: f(w, x), xs, **kw)), argnums=1)(w, xs)
    assert "backward pass of element 2 (of 6)" in notes(info.value)


# --------------------------------------------------------------------------------------------
# Packaging


def test_importing_gradmap_does_not_import_jax():
    code = "import sys, gradmap; assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_docstring_example():
    import doctest

    from gradmap._jax import _map

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner()
    for test in finder.find(_map.tmap, "tmap", globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def test_bench_runs_and_checks_gradients():
    from gradmap.bench import jax_bags

    results = jax_bags.run(n=3, reps=1, variants=("loop", "tmap", "serial"))
    assert set(results) == {"loop", "tmap", "serial"}
    for name in ("tmap", "serial"):
        assert results[name]["max_rel_grad_diff"] < 1e-4
        assert len(results[name]["times_s"]) == 1
    assert "vs loop" in jax_bags.format_results(results, 3)


# --------------------------------------------------------------------------------------------
# tsum: the sum of f, each element one compiled step under differentiation


def loop_sum(f: Any, *iterables: Any, **_: Any) -> Any:
    """The plain loop ``tsum`` replaces: f's results added leaf by leaf, in element order."""
    results = list(map(f, *iterables))
    total = results[0]
    for r in results[1:]:
        total = jax.tree_util.tree_map(lambda a, b: a + b, total, r)
    return total


@pytest.mark.parametrize("chunksize", [1, 3, None])
def test_tsum_equals_the_loop_eagerly(kw, chunksize):
    kw = {**kw, "chunksize": chunksize}
    xs = bags()

    def f(x: jax.Array) -> Any:
        return {"s": x.sum(axis=0), "n": x.shape[0], "m": jnp.max(x)}

    assert_trees_close(gmj.tsum(f, xs, **kw), loop_sum(f, xs))
    with pytest.raises(ValueError, match=r"^gradmap.jax.tsum: there are no elements"):
        gmj.tsum(lambda x: x, [], **kw)  # as gradmap.tsum


@pytest.mark.parametrize("chunksize", [1, 3, None])
@pytest.mark.parametrize("f", [bag_loss, bag_loss_jit], ids=["general", "jitted"])
def test_tsum_value_and_grad_equal_the_loop(kw, f, chunksize):
    kw = {**kw, "chunksize": chunksize}
    p, xs = params(), bags()

    def total(p: Any, xs: Any, ts: Any) -> jax.Array:
        return ts(lambda x: f(p, x), xs, **(kw if ts is gmj.tsum else {}))

    got = jax.value_and_grad(total, argnums=(0, 1))(p, xs, gmj.tsum)
    expected = jax.value_and_grad(total, argnums=(0, 1))(p, xs, loop_sum)
    assert_trees_close(got, expected)
    # jax.vjp with a cotangent other than one scales the summed gradients
    _, pullback = jax.vjp(lambda p: total(p, xs, gmj.tsum), p)
    _, pullback_l = jax.vjp(lambda p: total(p, xs, loop_sum), p)
    assert_trees_close(pullback(jnp.float32(-2.5)), pullback_l(jnp.float32(-2.5)))


def test_tsum_check_grads_numerically(kw):
    xs = bags(5)

    def total(w: jax.Array, b: jax.Array) -> jax.Array:
        return gmj.tsum(lambda x: bag_loss_jit({"w": w, "b": b}, x), xs, **kw)

    p = params()
    check_grads(total, (p["w"], p["b"]), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_tsum_results_that_are_not_one_loss(kw):
    """Vector results, several differentiable leaves, Python and integer leaves: the pullback
    path, and the loop's gradients."""
    p, xs = params(), bags(6)

    def f(p: Any, x: jax.Array) -> Any:
        y = jnp.tanh(x @ p["w"] + p["b"])
        return {"v": y.sum(axis=0), "l": (y**2).mean(), "k": 2, "i": jnp.argmax(y.sum(0))}

    def total(p: Any, ts: Any) -> tuple[jax.Array, Any]:
        s = ts(lambda x: f(p, x), xs, **(kw if ts is gmj.tsum else {}))
        return (s["v"] * jnp.arange(1.0, 3.0)).sum() + 3 * s["l"], (s["k"], int(s["i"]))

    got = jax.value_and_grad(total, has_aux=True)(p, gmj.tsum)
    expected = jax.value_and_grad(total, has_aux=True)(p, loop_sum)
    assert got[0][1] == expected[0][1]
    assert_trees_close((got[0][0], got[1]), (expected[0][0], expected[1]))
    jac = jax.jacrev(lambda p: gmj.tsum(lambda x: f(p, x)["v"], xs, **kw))(p)
    assert_trees_close(jac, jax.jacrev(lambda p: loop_sum(lambda x: f(p, x)["v"], xs))(p))


def test_tsum_gradients_are_bitwise_the_same_for_any_workers():
    p, xs = params(), bags(16)

    def grad(**kw: Any) -> Any:
        return jax.grad(lambda p: gmj.tsum(lambda x: bag_loss_jit(p, x), xs, chunksize=3, **kw))(p)

    reference = grad(executor="serial")
    for workers in (1, 2, 4):
        for a, b in zip(
            jax.tree_util.tree_leaves(grad(workers=workers)), jax.tree_util.tree_leaves(reference)
        ):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_tsum_under_other_transformations_is_the_loop():
    kw = ONE_EXECUTOR
    xs = bags(4)
    w = jnp.asarray([0.3, -0.2, 0.5], jnp.float32)

    def total(w: jax.Array, ts: Any) -> jax.Array:
        return ts(
            lambda x: jnp.sin(x @ w).sum() * (w**2).sum(), xs, **(kw if ts is gmj.tsum else {})
        )

    assert_trees_close(jax.jit(total, static_argnums=1)(w, gmj.tsum), total(w, loop_sum))
    assert_trees_close(jax.hessian(total)(w, gmj.tsum), jax.hessian(total)(w, loop_sum), rtol=1e-4)
    ws = jnp.stack([w, 2 * w])
    assert_trees_close(
        jax.vmap(total, (0, None))(ws, gmj.tsum), jax.vmap(total, (0, None))(ws, loop_sum)
    )
    t = jnp.ones(3)
    assert_trees_close(
        jax.jvp(lambda w: total(w, gmj.tsum), (w,), (t,)),
        jax.jvp(lambda w: total(w, loop_sum), (w,), (t,)),
    )


def test_tsum_reuses_traces_across_calls_and_passes_the_closure_anew():
    """The same code over new arrays is not traced again; its arrays are the new ones."""

    class Log:  # not a pytree: the key holds it by identity, not by its contents
        def __init__(self) -> None:
            self.shapes: list[Any] = []

    log = Log()
    xs = bags(8)
    traced = log.shapes
    scale = {"s": 1.0}
    offset = np.float32(0.0)

    def make_loss(p: Any) -> Any:
        def loss(x: jax.Array) -> jax.Array:
            log.shapes.append(x.shape)
            return bag_loss(p, x) * scale["s"] + offset

        return loss

    def total(p: Any) -> Any:
        return gmj.tsum(make_loss(p), xs, executor="serial")

    def expected(p: Any) -> Any:
        return jax.value_and_grad(lambda p: loop_sum(make_loss(p), xs))(p)

    p = params()
    jax.value_and_grad(total)(p)
    count = len(traced)
    assert count == 4  # one trace per shape
    p2 = jax.tree_util.tree_map(lambda a: a * 3 + 1, p)  # new values, same shapes
    got = jax.value_and_grad(total)(p2)
    assert len(traced) == count  # not traced again
    traced.clear()
    assert_trees_close(got, expected(p2))
    scale["s"] = 2.0  # a Python value in the closure: traced again, with the new value
    assert_trees_close(jax.value_and_grad(total)(p2), expected(p2))
    assert traced
    p3 = {"w": jnp.ones((3, 5)), "b": jnp.zeros(5)}  # new shapes: traced again
    assert_trees_close(jax.value_and_grad(total)(p3), expected(p3))
    offset = np.float32(1.5)  # a closure cell rebound to a new value
    traced.clear()
    assert_trees_close(jax.value_and_grad(total)(p3), expected(p3))


def test_tsum_reads_globals_and_opaque_objects_anew():
    """Arrays reached through an object that is not a pytree are constants of a trace used
    for one call only: a new array there is seen."""

    class Holder:
        pass

    holder = Holder()
    xs = bags(4)
    for k in range(3):
        holder.w = jnp.full((3, 2), float(k + 1), jnp.float32)
        got = jax.grad(
            lambda b: gmj.tsum(lambda x: (jnp.tanh(x @ holder.w + b)).sum(), xs, executor="serial")
        )(jnp.zeros(2))
        expected = jax.grad(lambda b: loop_sum(lambda x: (jnp.tanh(x @ holder.w + b)).sum(), xs))(
            jnp.zeros(2)
        )
        assert_trees_close(got, expected)


def test_tsum_branch_on_an_array_value_runs_the_loop_with_a_warning(kw):
    p, xs = params(), bags(5)

    def f(p: Any, x: jax.Array) -> jax.Array:
        if x.sum() > 0:
            return bag_loss(p, x)
        return -bag_loss(p, x)

    with pytest.warns(RuntimeWarning, match="gradmap.jax.tsum: element .* could not be traced"):
        got = jax.grad(lambda p: gmj.tsum(lambda x: f(p, x), xs, **kw))(p)
    assert_trees_close(got, jax.grad(lambda p: loop_sum(lambda x: f(p, x), xs))(p))


@pytest.mark.parametrize("where", ["eager", "grad", "jit"])
def test_tsum_forward_error_names_the_element_and_tsum(kw, where):
    w = jnp.ones(3)

    def total(w: jax.Array) -> jax.Array:
        def f(i: int) -> jax.Array:
            if i == 3:
                raise Boom("three")
            return (w * i).sum()

        return gmj.tsum(f, range(6), **kw)

    run = {"eager": total, "grad": jax.grad(total), "jit": jax.jit(total)}[where]
    with pytest.raises(Boom) as info:
        run(w)
    assert "gradmap.jax.tsum: raised in the forward pass of element 3 (of 6)" in notes(info.value)


@pytest.mark.parametrize("jit", [False, True], ids=["general", "jitted"])
def test_tsum_backward_error_names_the_element(kw, jit):
    xs = bags(6)  # element 2 has 3 rows
    f = (
        jax.jit(lambda w, x: (_fragile(x) @ w).sum())
        if jit
        else (lambda w, x: (_fragile(x) @ w).sum())
    )
    w = params()["w"]
    with pytest.raises(Boom, match="3 rows") as info:
        jax.grad(lambda w, xs: gmj.tsum(lambda x: f(w, x), xs, **kw), argnums=1)(w, xs)
    assert "gradmap.jax.tsum: raised in the backward pass of element 2 (of 6)" in notes(info.value)


@pytest.mark.parametrize("where", ["eager", "grad"])
def test_tsum_results_of_different_structures_are_an_error(kw, where):
    def total(w: jax.Array) -> Any:
        def f(i: int) -> Any:
            return {"a": w * i} if i not in (4, 5) else {"b": w * i}

        return sum(jax.tree_util.tree_leaves(gmj.tsum(f, range(7), **kw)))

    run = total if where == "eager" else jax.grad(total)
    with pytest.raises(TypeError, match=r"gradmap\.jax\.tsum: element 4 returned") as info:
        run(jnp.float32(2.0))
    assert "element 4 (of 7)" in notes(info.value)


def test_argument_errors_name_the_jax_api():
    for api in (gmj.tmap, gmj.tsum):
        name = f"gradmap.jax.{api.__name__}"
        with pytest.raises(TypeError, match=f"{name}: f must be callable"):
            api(3, [1])
        with pytest.raises(ValueError, match=f"{name}: chunksize must be at least 1"):
            api(lambda x: x, [1], chunksize=0)
        with pytest.raises(ValueError, match=f"{name}: workers must be at least 1"):
            api(lambda x: x, [1], workers=0)
        with pytest.raises(ValueError, match=f"{name}: unknown executor"):
            api(lambda x: x, [1], executor="nope")
        with pytest.raises(TypeError, match=f"{name}: the 'processes' executor runs chunks in"):
            api(lambda x: x, [1], executor="processes")
        with pytest.raises(ValueError, match=rf"{name}\(strict=True\)"):
            api(lambda x, y: x, [1], [1, 2], strict=True)
        with pytest.raises(TypeError, match=f"{name}: iterable 0 is a 0-d array"):
            api(lambda x: x, jnp.float32(1.0))


def test_tmap_without_kept_gradients_is_the_same(kw, monkeypatch):
    """Past the budget of kept gradients, elements take the compiled pullback: same result."""
    from gradmap._jax import _element

    p, xs = params(), bags()

    def grad() -> Any:
        return jax.grad(lambda p: total_loss(gmj.tmap, bag_loss_jit, p, xs, **kw))(p)

    kept = grad()
    monkeypatch.setattr(_element, "STORED_GRADIENTS", 0)
    assert_trees_close(grad(), kept)
    assert_trees_close(kept, jax.grad(lambda p: total_loss(loop, bag_loss_jit, p, xs))(p))


def test_importing_gradmap_jax_does_not_import_torch():
    code = (
        "import sys, gradmap.jax; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_tsum_docstring_example():
    import doctest

    from gradmap._jax import _map

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(_map.tsum, "tsum", globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


def test_bench_has_tsum_against_the_loop_of_value_and_grad():
    from gradmap.bench import jax_bags

    results = jax_bags.run(n=3, reps=1, variants=("loop", "loop_vg", "tsum"))
    assert results["tsum"]["max_rel_grad_diff"] < 1e-4
    assert "vs loop_vg" in jax_bags.format_results(results, 3)
