"""Real clients: third-party and real-world code run inside ``gradmap.tmap``.

Each case maps a small, realistic ``f`` -- an ODE solve (torchdiffeq, adjoint method included),
message passing on graphs (plain ``index_add_``/``scatter_add``, torch_geometric), preallocated
buffers filled with ``__setitem__``, an adjoint-style ``autograd.Function``, lazy kernel operators
with their own ``__torch_function__`` (hand-written and linear_operator's), ``torch.func`` inside
``f``, activation checkpointing, ``torch.compile``, random numbers, batch norm under ``remat`` --
and compares the map with the plain loop ``[f(x) for x in xs]``: the results, and the gradients to
the items, to module parameters and to closure tensors, through ``torch.autograd.grad`` and through
``.backward()`` into ``.grad``. Everything is float64 and tiny; chunks of 1-3 elements, so that
every map has several chunks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint

import gradmap

from support import executor_kwargs, loop

F64 = torch.float64

# -- harness --------------------------------------------------------------------------------------

CLIENT_EXECUTORS = ["serial", "threads-2", "user-pool"]


@pytest.fixture(params=CLIENT_EXECUTORS)
def ex(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """``tmap`` keyword arguments for one executor: serial, the shared pool with 2 workers, or a
    user's ``ThreadPoolExecutor(2)``."""
    with executor_kwargs(request.param) as (kwargs, _):
        yield kwargs


def _float_leaves(tree: Any) -> list[Tensor]:
    return [
        leaf
        for leaf in pytree.tree_leaves(tree)
        if isinstance(leaf, Tensor) and leaf.is_floating_point()
    ]


def weighted_loss(results: list[Any]) -> Tensor:
    """A scalar that gives every element, and every entry of every result, a cotangent of its own
    (so that a gradient sent to the wrong element or entry shows)."""
    total = torch.zeros((), dtype=F64)
    for i, result in enumerate(results):
        for leaf in _float_leaves(result):
            if leaf.requires_grad:
                w = torch.linspace(0.5, 1.5, leaf.numel(), dtype=leaf.dtype).reshape(leaf.shape)
                total = total + (i + 1) * (leaf * w).sum()
    return total


def gradients(loss: Tensor, wrt: Sequence[Tensor], mode: str) -> list[Tensor | None]:
    """``loss``'s gradients to ``wrt``: by ``torch.autograd.grad``, or by ``.backward()`` into
    ``.grad`` (cleared before and after)."""
    if mode == "grad":
        return list(torch.autograd.grad(loss, list(wrt), allow_unused=True))
    for t in wrt:
        t.grad = None
    loss.backward()
    out = [t.grad for t in wrt]
    for t in wrt:
        t.grad = None
    return out


def assert_matches_loop(
    f: Callable[..., Any],
    iterables: Sequence[Sequence[Any]],
    wrt: Sequence[Tensor],
    ex: dict[str, Any],
    *,
    chunksize: int,
    modes: Sequence[str] = ("grad", "backward"),
) -> None:
    """``gradmap.tmap(f, *iterables)`` gives the loop's results, and the loop's gradients to every
    tensor of ``wrt`` (each of which the loop's results depend on), in every mode."""
    for mode in modes:
        expected = loop(f, *iterables)
        got = gradmap.tmap(f, *iterables, chunksize=chunksize, **ex)
        torch.testing.assert_close(got, expected)
        assert [t.requires_grad for r in got for t in _float_leaves(r)] == [
            t.requires_grad for r in expected for t in _float_leaves(r)
        ], "results that require grad"
        want = gradients(weighted_loss(expected), wrt, mode)
        missing = [i for i, g in enumerate(want) if g is None]
        assert not missing, f"test setup: the loop gives wrt{missing} no gradient"
        assert any(bool(g.abs().sum() > 0) for g in want if g is not None), "all-zero gradients"
        have = gradients(weighted_loss(got), wrt, mode)
        torch.testing.assert_close(have, want, msg=lambda m, mode=mode: f"{mode}: {m}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, g: torch.Generator, grad: bool = True) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def mlp(*sizes: int, seed: int = 0) -> nn.Sequential:
    """A float64 MLP with tanh between its linear layers, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers).to(F64)


# -- ODE solves: torchdiffeq ----------------------------------------------------------------------


class VectorField(nn.Module):
    """dy/dt = net(y) * cos(t): a small time-dependent field."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(2, 8, 2, seed=1)

    def forward(self, t: Tensor, y: Tensor) -> Tensor:
        return self.net(y) * torch.cos(t)


def _initial_values_and_spans(n: int = 4) -> tuple[list[Tensor], list[Tensor]]:
    """Per-element initial states and time spans (of different ends and lengths)."""
    g = _gen(2)
    y0s = [_randn(2, g=g) for _ in range(n)]
    ts = [torch.linspace(0.0, 0.4 + 0.2 * i, 3 + i % 2, dtype=F64) for i in range(n)]
    return y0s, ts


@pytest.mark.parametrize(
    "method, options",
    [("rk4", {"step_size": 0.1}), ("dopri5", {})],
    ids=["rk4", "dopri5"],
)
def test_torchdiffeq_odeint(ex, method, options):
    torchdiffeq = pytest.importorskip("torchdiffeq")
    field = VectorField()
    y0s, ts = _initial_values_and_spans()

    def solve(y0: Tensor, t: Tensor) -> Tensor:
        return torchdiffeq.odeint(
            field, y0, t, method=method, options=options, rtol=1e-6, atol=1e-8
        )

    assert_matches_loop(solve, [y0s, ts], [*y0s, *field.parameters()], ex, chunksize=1)


def test_torchdiffeq_odeint_adjoint(ex):
    """The adjoint method: a custom autograd.Function whose backward solves the adjoint ODE,
    running the field again and taking ``autograd.grad`` w.r.t. its parameters."""
    torchdiffeq = pytest.importorskip("torchdiffeq")
    field = VectorField()
    y0s, ts = _initial_values_and_spans()

    def solve(y0: Tensor, t: Tensor) -> Tensor:
        return torchdiffeq.odeint_adjoint(
            field, y0, t, method="rk4", options={"step_size": 0.1}, rtol=1e-6, atol=1e-8
        )

    assert_matches_loop(solve, [y0s, ts], [*y0s, *field.parameters()], ex, chunksize=2)


# -- message passing on graphs --------------------------------------------------------------------


def _graphs(sizes: Sequence[int] = (3, 5, 2, 4, 6)) -> tuple[list[Tensor], list[Tensor]]:
    """Node features (requiring grad) and edge indices of graphs of different sizes."""
    g = _gen(3)
    xs, edges = [], []
    for n in sizes:
        xs.append(_randn(n, 3, g=g))
        edges.append(torch.randint(0, n, (2, 2 * n), generator=g))
    return xs, edges


class TinyGNN(nn.Module):
    """One message-passing layer (mean of transformed neighbours) and a sum readout."""

    def __init__(self, aggregate: str) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.message = nn.Linear(3, 4).to(F64)
        self.update = nn.Linear(3 + 4, 4).to(F64)
        self.aggregate = aggregate

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index
        n, m = x.shape[0], torch.tanh(self.message(x))[src]
        if self.aggregate == "index_add_":
            agg = torch.zeros(n, 4, dtype=F64).index_add_(0, dst, m)
        else:
            agg = torch.zeros(n, 4, dtype=F64).scatter_add(0, dst.unsqueeze(-1).expand_as(m), m)
        deg = torch.zeros(n, dtype=F64).index_add_(0, dst, torch.ones(dst.shape[0], dtype=F64))
        h = torch.tanh(self.update(torch.cat([x, agg / deg.clamp(min=1).unsqueeze(-1)], dim=-1)))
        return h.sum(0)


@pytest.mark.parametrize("aggregate", ["index_add_", "scatter_add"])
def test_message_passing_with_index_add_and_scatter_add(ex, aggregate):
    gnn = TinyGNN(aggregate)
    xs, edges = _graphs()
    assert_matches_loop(gnn, [xs, edges], [*xs, *gnn.parameters()], ex, chunksize=2)


def test_torch_geometric_gcnconv(ex):
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(5)
    conv = pyg_nn.GCNConv(3, 4).to(F64)
    xs, edges = _graphs()

    def f(x: Tensor, edge_index: Tensor) -> Tensor:
        return torch.tanh(conv(x, edge_index)).sum(0)

    assert_matches_loop(f, [xs, edges], [*xs, *conv.parameters()], ex, chunksize=2)


# -- preallocated buffers written with __setitem__ ------------------------------------------------


def test_preallocated_buffer_setitem(ex):
    w = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    g = _gen(6)
    xs = [_randn(2, 3, g=g) for _ in range(5)]

    def f(x: Tensor) -> Tensor:
        b = torch.zeros(2, 3, dtype=F64)
        b[0] = x[0] * 2
        b[1] = x[1] * w
        b[1, 2] = x[0, 0] * x[1, 1]
        b[:, 0] += w[0]
        return b

    assert_matches_loop(f, [xs], [*xs, w], ex, chunksize=2)


def test_hand_written_rnn_fills_a_preallocated_output(ex):
    torch.manual_seed(7)
    cell_in = nn.Linear(2, 4).to(F64)
    cell_h = nn.Linear(4, 4, bias=False).to(F64)
    g = _gen(7)
    seqs = [_randn(t, 2, g=g) for t in (3, 5, 2, 4)]

    def f(seq: Tensor) -> Tensor:
        out = torch.zeros(seq.shape[0], 4, dtype=F64)
        h = torch.zeros(4, dtype=F64)
        for t in range(seq.shape[0]):
            h = torch.tanh(cell_in(seq[t]) + cell_h(h))
            out[t] = h
        return out

    params = [*cell_in.parameters(), *cell_h.parameters()]
    assert_matches_loop(f, [seqs], [*seqs, *params], ex, chunksize=1)


def test_explicit_euler_fills_a_preallocated_solution(ex):
    field = mlp(2, 6, 2, seed=8)
    g = _gen(8)
    y0s = [_randn(2, g=g) for _ in range(5)]
    steps = [3, 6, 2, 5, 4]
    dt = torch.tensor(0.1, dtype=F64, requires_grad=True)

    def f(y0: Tensor, n_steps: int) -> Tensor:
        sol = torch.empty(n_steps + 1, 2, dtype=F64)
        sol[0] = y0
        y = y0
        for i in range(n_steps):
            y = y + dt * field(y)
            sol[i + 1] = y
        return sol

    assert_matches_loop(f, [y0s, steps], [*y0s, dt, *field.parameters()], ex, chunksize=2)


# -- an adjoint-style autograd.Function -----------------------------------------------------------


class RerunModule(torch.autograd.Function):
    """``module(x)``, with the module's parameters passed in as inputs, and a backward that runs
    the module again under grad mode and takes ``autograd.grad`` w.r.t. its parameters (as
    adjoint ODE solvers and memory-saving layers do)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, module: nn.Module, *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.module = module
        ctx.save_for_backward(x)
        return module(x)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params = tuple(ctx.module.parameters())
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(True)
            y = ctx.module(x_)
            grads = torch.autograd.grad(y, (x_, *params), grad_out, allow_unused=True)
        return (grads[0], None, *grads[1:])


def test_custom_function_rerunning_a_module_in_its_backward(ex):
    module = mlp(3, 5, 2, seed=9)
    g = _gen(9)
    xs = [_randn(k, 3, g=g) for k in (2, 4, 1, 3, 2)]

    def f(x: Tensor) -> Tensor:
        return RerunModule.apply(x, module, *module.parameters()).square().sum(0)

    assert_matches_loop(f, [xs], [*xs, *module.parameters()], ex, chunksize=2)


# -- lazy kernel operators with their own __torch_function__ --------------------------------------


def _gp_data(sizes: Sequence[int] = (3, 5, 4, 6)) -> tuple[list[Tensor], list[Tensor]]:
    g = _gen(10)
    return [_randn(n, 2, g=g) for n in sizes], [_randn(n, g=g) for n in sizes]


def _hyperparameters() -> dict[str, Tensor]:
    return {
        "log_lengthscale": torch.tensor([0.1, -0.2], dtype=F64, requires_grad=True),
        "log_outputscale": torch.tensor(0.3, dtype=F64, requires_grad=True),
        "log_noise": torch.tensor(-1.0, dtype=F64, requires_grad=True),
    }


def rbf(x1: Tensor, x2: Tensor, lengthscale: Tensor, outputscale: Tensor) -> Tensor:
    z1, z2 = x1 / lengthscale, x2 / lengthscale
    return outputscale * torch.exp(-0.5 * (z1.unsqueeze(-2) - z2.unsqueeze(-3)).square().sum(-1))


class LazyKernel:
    """A kernel matrix ``k(x, x) + noise * I`` kept lazily, as GP libraries keep one: not a
    tensor, but torch functions accept it through ``__torch_function__``: ``torch.logdet`` and
    ``torch.linalg.solve`` go through its Cholesky factor, anything else through its dense form."""

    def __init__(self, x: Tensor, hyper: dict[str, Tensor]) -> None:
        self.x = x
        self.hyper = hyper

    def to_dense(self) -> Tensor:
        h = self.hyper
        k = rbf(self.x, self.x, h["log_lengthscale"].exp(), h["log_outputscale"].exp())
        return k + h["log_noise"].exp() * torch.eye(self.x.shape[0], dtype=F64)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.logdet:
            (op,) = args
            return 2 * torch.linalg.cholesky(op.to_dense()).diagonal().log().sum()
        if func is torch.linalg.solve:
            op, rhs = args
            chol = torch.linalg.cholesky(op.to_dense())
            return torch.cholesky_solve(rhs.unsqueeze(-1), chol).squeeze(-1)
        dense = [a.to_dense() if isinstance(a, cls) else a for a in args]
        return func(*dense, **kwargs)


def test_lazy_kernel_wrapper_with_torch_function(ex):
    hyper = _hyperparameters()
    xs, ys = _gp_data()

    def nll(x: Tensor, y: Tensor) -> Tensor:
        k = LazyKernel(x, hyper)
        fit = y @ torch.linalg.solve(k, y)
        return 0.5 * fit + 0.5 * torch.logdet(k) + 0.01 * torch.trace(k) + torch.matmul(k, y)[0]

    assert_matches_loop(nll, [xs, ys], [*xs, *ys, *hyper.values()], ex, chunksize=1)


class KernelTensor(torch.Tensor):
    """A kernel matrix as a tensor subclass: ``torch.logdet`` and ``torch.linalg.solve`` go
    through its Cholesky factor; every other op is the tensor op (results stay KernelTensors)."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.logdet:
            chol = torch.linalg.cholesky(args[0])
            return 2 * chol.diagonal().log().sum()
        if func is torch.linalg.solve:
            a, rhs = args
            return torch.cholesky_solve(rhs.unsqueeze(-1), torch.linalg.cholesky(a)).squeeze(-1)
        return super().__torch_function__(func, types, args, kwargs)


def test_kernel_tensor_subclass_with_torch_function(ex):
    hyper = _hyperparameters()
    xs, ys = _gp_data()

    def nll(x: Tensor, y: Tensor) -> Tensor:
        dense = LazyKernel(x, hyper).to_dense()
        k = dense.as_subclass(KernelTensor)
        fit = y @ torch.linalg.solve(k, y)
        return (0.5 * fit + 0.5 * torch.logdet(k) + 0.01 * k.diagonal().sum()).as_subclass(Tensor)

    assert_matches_loop(nll, [xs, ys], [*xs, *ys, *hyper.values()], ex, chunksize=2)


def test_linear_operator_kernel_operator(ex):
    """linear_operator's real objects: a KernelLinearOperator (whose matmul is an autograd.Function
    taking the hyperparameters as inputs, and whose backward runs the kernel again under grad mode)
    plus a diagonal, through ``torch.matmul`` (``__torch_function__``) and ``inv_quad_logdet``."""
    pytest.importorskip("linear_operator")
    from linear_operator.operators import KernelLinearOperator

    hyper = _hyperparameters()
    xs, ys = _gp_data()

    def nll(x: Tensor, y: Tensor) -> Tensor:
        k = KernelLinearOperator(
            x,
            x,
            covar_func=rbf,
            lengthscale=hyper["log_lengthscale"].exp().unsqueeze(0),
            outputscale=hyper["log_outputscale"].exp(),
            num_nonbatch_dimensions={"outputscale": 0},
        )
        noisy = k.add_diagonal(hyper["log_noise"].exp().expand(x.shape[0]))
        inv_quad, logdet = noisy.inv_quad_logdet(inv_quad_rhs=y.unsqueeze(-1), logdet=True)
        smooth = torch.matmul(k, y.unsqueeze(-1)).squeeze(-1)
        return torch.stack([0.5 * (inv_quad + logdet), smooth.square().sum()])

    assert_matches_loop(nll, [xs, ys], [*xs, *ys, *hyper.values()], ex, chunksize=2)


# -- torch.func inside f --------------------------------------------------------------------------


def test_torch_func_grad_inside_f_gradient_penalty(ex):
    model = mlp(3, 6, 1, seed=11)
    g = _gen(11)
    xs = [_randn(3, g=g) for _ in range(5)]

    def energy(z: Tensor) -> Tensor:
        return model(z).squeeze(-1)

    def f(x: Tensor) -> Tensor:
        slope = torch.func.grad(energy)(x)
        return energy(x) + 0.5 * slope.square().sum()

    assert_matches_loop(f, [xs], [*xs, *model.parameters()], ex, chunksize=2)


def test_torch_func_jacrev_inside_f(ex):
    torch.manual_seed(12)
    lin = nn.Linear(3, 2).to(F64)
    g = _gen(12)
    xs = [_randn(3, g=g) for _ in range(5)]

    def f(x: Tensor) -> tuple[Tensor, Tensor]:
        jac = torch.func.jacrev(lambda z: torch.tanh(lin(z)))(x)
        return torch.tanh(lin(x)), jac.square().sum()

    assert_matches_loop(f, [xs], [*xs, *lin.parameters()], ex, chunksize=2)


# -- activation checkpointing ---------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_inside_f(ex, use_reentrant):
    block = mlp(3, 8, 3, seed=13)
    scale = torch.tensor(0.7, dtype=F64, requires_grad=True)
    g = _gen(13)
    xs = [_randn(k, 3, g=g) for k in (2, 3, 1, 4, 2)]

    def f(x: Tensor) -> Tensor:
        h = checkpoint(lambda z: block(z) * scale, x, use_reentrant=use_reentrant)
        return torch.tanh(h).sum(0)

    # The reentrant variant supports .backward() only (not torch.autograd.grad), as in the loop.
    modes = ("backward",) if use_reentrant else ("grad", "backward")
    wrt = [*xs, scale, *block.parameters()]
    assert_matches_loop(f, [xs], wrt, ex, chunksize=2, modes=modes)


# -- torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_inside_f(ex, backend):
    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("torch.compile (dynamo) is not supported on this Python")
    torch._dynamo.reset()
    model = mlp(3, 5, 1, seed=14)
    compiled = torch.compile(model, backend=backend)
    g = _gen(14)
    xs = [_randn(k, 3, g=g) for k in (2, 3, 2, 3)]

    def f(x: Tensor) -> Tensor:
        return compiled(x).square().sum()

    try:
        loop(f, xs)
    except Exception as exc:  # pragma: no cover - depends on the installation
        pytest.skip(f"torch.compile(backend={backend!r}) is unavailable here: {exc!r}")
    try:
        assert_matches_loop(f, [xs], [*xs, *model.parameters()], ex, chunksize=2)
    finally:
        torch._dynamo.reset()


class _DonatingBackward(torch.autograd.Function):
    """``x * w`` whose backward refuses to run with the graph kept, with the message of a backward
    compiled by ``torch.compile`` that donates its saved tensors (AOTAutograd's check, which the
    small models here do not set off)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor]:
        if torch._C._autograd._get_current_graph_task_keep_graph():
            raise RuntimeError(
                "This backward function was compiled with non-empty donated buffers which "
                "requires create_graph=False and retain_graph=False."
            )
        x, w = ctx.saved_tensors
        return g * w, g * x


def test_backward_that_donates_its_buffers(ex):
    # Pullbacks keep their graph (NOTE [pullbacks keep their graph]); one that meets such a
    # backward runs again freeing it, as the loop's backward() does.
    g = _gen(15)
    w = _randn(3, g=g)
    xs = [_randn(3, g=g) for _ in range(5)]

    def f(x: Tensor) -> Tensor:
        return _DonatingBackward.apply(x.sin(), w).square().sum()

    assert_matches_loop(f, [xs], [*xs, w], ex, chunksize=2)
    want = torch.autograd.grad(sum(f(x) for x in xs), [*xs, w])
    got = torch.autograd.grad(gradmap.tsum(f, xs, chunksize=2, **ex), [*xs, w])
    torch.testing.assert_close(got, want)


# -- random numbers -------------------------------------------------------------------------------

RANDOM_CONFIGS = {
    "serial": {"executor": "serial"},
    "threads-1": {"executor": None, "workers": 1},
    "threads-2": {"executor": None, "workers": 2},
    "threads-4": {"executor": None, "workers": 4},
    "user-pool": {"executor": "user-pool"},
}


def _noisy_map(config: str, grad_mode: bool, chunksize: int = 2, seed: int = 0) -> list[Tensor]:
    """A random ``f`` (dropout, ``torch.rand``, ``torch.randn``) mapped under ``config``, with the
    global generator seeded just before the call."""
    w = torch.linspace(0.5, 1.5, 4, dtype=F64, requires_grad=True)
    xs = [torch.ones(4, dtype=F64, requires_grad=True) for _ in range(6)]

    def noisy(x: Tensor) -> Tensor:
        return F.dropout(x * w, p=0.5, training=True) + torch.rand(4, dtype=F64) + torch.randn(())

    kwargs = dict(RANDOM_CONFIGS[config])
    with contextlib.ExitStack() as stack:
        if kwargs["executor"] == "user-pool":
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
            kwargs["executor"] = stack.enter_context(pool)
        if not grad_mode:
            stack.enter_context(torch.no_grad())
        torch.manual_seed(seed)
        ys = gradmap.tmap(noisy, xs, chunksize=chunksize, **kwargs)
    assert all(y.requires_grad == grad_mode for y in ys)
    return [y.detach() for y in ys]


@pytest.mark.parametrize("grad_mode", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("config", list(RANDOM_CONFIGS))
def test_random_f_same_draws_across_runs_workers_executors_and_grad_mode(config, grad_mode):
    """The map's draws are its own (they need not be the loop's), but the same for two runs, for
    any workers and executor, and under no_grad as under grad mode."""
    reference = _noisy_map("serial", grad_mode=True)
    # The reference is random at all: the elements' items are equal, their results are not.
    assert not torch.equal(reference[0], reference[1])
    assert not torch.equal(reference[0], _noisy_map("serial", grad_mode=True, seed=1)[0])
    first = _noisy_map(config, grad_mode)
    second = _noisy_map(config, grad_mode)
    torch.testing.assert_close(first, second, rtol=0, atol=0, msg="two runs differ")
    torch.testing.assert_close(first, reference, rtol=0, atol=0)


@pytest.mark.parametrize("chunksize", [1, 3, 6])
def test_random_f_same_draws_for_any_chunksize(chunksize):
    """Every element draws from a generator of its own: chunks do not change the draws."""
    reference = _noisy_map("serial", grad_mode=True, chunksize=2)
    torch.testing.assert_close(
        _noisy_map("threads-2", grad_mode=True, chunksize=chunksize), reference, rtol=0, atol=0
    )


@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_a_map_takes_one_draw_whatever_runs_it(api):
    """NOTE [the generator after a map]: what a program draws after a map of an ``f`` that draws
    nothing is the same for every executor and placement (a forward in one thread, ``one``; on
    the pool, ``workers=2``), run after run: the map took exactly one draw."""
    w = torch.ones(3, requires_grad=True)
    xs = [torch.full((3,), float(i)) for i in range(12)]

    def after(**kwargs: Any) -> float:
        torch.manual_seed(3)
        mapped = gradmap.tsum if api == "tsum" else gradmap.tmap
        mapped(lambda x: (x * w).sum(), xs, chunksize=2, **kwargs)
        return float(torch.rand(()))

    want = after(executor="serial")
    torch.manual_seed(3)
    assert want != float(torch.rand(()))  # the map drew
    for kwargs in ({"executor": "serial"}, {}, {"workers": 2}, {"workers": 1}) * 2:
        assert after(**kwargs) == want, kwargs


def _checkpointed_dropout(config: str, api: str) -> tuple[Tensor, list[Tensor]]:
    """A map of an ``f`` whose checkpointed block draws dropout masks, which the block's
    recompute in the backward draws again from the generator state it saved."""
    torch.manual_seed(21)
    block = nn.Sequential(
        nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 32), nn.Dropout(0.3)
    ).double()
    xs = [torch.randn(int(k), 8, dtype=F64) for k in torch.randint(3, 30, (32,))]

    def f(x: Tensor) -> Tensor:
        return checkpoint(block, x, use_reentrant=False).pow(2).mean()

    with executor_kwargs(config) as (kwargs, _):
        for _ in range(3):  # (a tmap learns to pull its losses back during the forward)
            torch.manual_seed(5)
            if api == "tsum":
                total = gradmap.tsum(f, xs, chunksize=2, **kwargs)
            else:
                total = torch.stack(gradmap.tmap(f, xs, chunksize=2, **kwargs)).sum()
            grads = list(torch.autograd.grad(total, list(block.parameters())))
    return total.detach(), grads


@pytest.mark.parametrize("api", ["tsum", "tmap"])
@pytest.mark.parametrize("config", ["threads", "threads-4", "user-pool"])
def test_checkpoint_recomputes_draw_what_the_forward_drew(config, api):
    """NOTE [random numbers of recomputes]: a recompute in one chunk's pullback sets the global
    generator back to redraw its dropout masks; on threads it ran under other chunks' forwards
    and pullbacks (off by 0.07 in value, 0.5 in gradient). The values and gradients are the
    serial executor's, up to the intra-op threads' order of sums."""
    want_value, want_grads = _checkpointed_dropout("serial", api)
    value, grads = _checkpointed_dropout(config, api)
    torch.testing.assert_close(value, want_value, rtol=1e-12, atol=1e-14)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# -- batch norm under remat -----------------------------------------------------------------------


def test_remat_batchnorm_buffers_updated_once(ex):
    """``remat=True`` runs ``f`` again in the backward; BatchNorm1d in train mode updates its
    running statistics and ``num_batches_tracked`` in every forward: after forward and backward,
    they must be the loop's (updated once per element)."""
    torch.manual_seed(15)
    bn_initial = nn.BatchNorm1d(3, momentum=0.1).to(F64).train()
    # Every element holds the same rows (small integers with integer column means) in its own
    # order: the batch statistics are exact, so the running statistics do not depend on the order
    # in which the elements update them.
    rows = torch.tensor([[1, -2, 0], [3, 0, 4], [-1, 2, 2], [1, 4, -2]], dtype=F64)
    orders = [[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0], [1, 3, 0, 2], [0, 2, 1, 3]]
    xs = [rows[order].clone().requires_grad_(True) for order in orders]
    head = torch.tensor([0.3, -0.7, 1.1], dtype=F64, requires_grad=True)

    def run(mapper: Callable[..., list[Any]], **kwargs: Any) -> tuple[nn.Module, list[Any]]:
        bn = copy.deepcopy(bn_initial)

        def f(x: Tensor) -> Tensor:
            return (torch.tanh(bn(x)) * head).sum(0)

        ys = mapper(f, xs, **kwargs)
        torch.autograd.backward(weighted_loss(ys))
        return bn, [*ys]

    def collect() -> list[Tensor | None]:
        out = [t.grad for t in [*xs, head]]
        for t in [*xs, head]:
            t.grad = None
        return out

    bn_loop, ys_loop = run(loop)
    grads_loop = collect()
    bn_map, ys_map = run(gradmap.tmap, chunksize=2, remat=True, **ex)
    grads_map = collect()

    torch.testing.assert_close(ys_map, ys_loop)
    torch.testing.assert_close(grads_map, grads_loop)
    assert int(bn_loop.num_batches_tracked) == len(xs)
    assert int(bn_map.num_batches_tracked) == len(xs), "num_batches_tracked"
    torch.testing.assert_close(bn_map.running_mean, bn_loop.running_mean, msg="running_mean")
    torch.testing.assert_close(bn_map.running_var, bn_loop.running_var, msg="running_var")
    for name in ("weight", "bias"):
        got, want = getattr(bn_map, name).grad, getattr(bn_loop, name).grad
        torch.testing.assert_close(got, want, msg=f"{name}.grad")


@pytest.mark.parametrize("workers", [None, 2], ids=["placed", "pool"])
@pytest.mark.parametrize("api", ["tmap", "tsum"])
def test_an_f_that_starts_drawing_is_seeded_per_element_from_its_next_call(
    api, workers, monkeypatch
):
    """NOTE [random numbers per element]: after a first call that drew nothing, calls seed the
    pass once (or run on the pool, unseeded); the call in which ``f`` starts drawing has the
    right gradients, and from the next call on every element draws from its own seed again, as
    the serial reference does."""
    from gradmap import _placement

    monkeypatch.setattr(_placement, "_history", {})  # f's code is the same in every case
    w = torch.linspace(0.5, 1.5, 4, dtype=F64, requires_grad=True)
    xs = [torch.full((4,), float(i), dtype=F64) for i in range(12)]
    drawing = [False]

    def f(x: Tensor) -> Tensor:
        y = x * w
        if drawing[0]:
            y = F.dropout(y, p=0.5, training=True)
        return y.sum()

    def run(executor: Any = None) -> tuple[Tensor, Tensor]:
        torch.manual_seed(3)
        kwargs: dict[str, Any] = {"chunksize": 4, "executor": executor}
        if executor is None:
            kwargs["workers"] = workers
        if api == "tsum":
            total = gradmap.tsum(f, xs, **kwargs)
        else:
            total = torch.stack(gradmap.tmap(f, xs, **kwargs)).sum()
        (g,) = torch.autograd.grad(total, w)
        return total.detach(), g

    run()  # draws nothing: later calls seed the pass once
    run()
    drawing[0] = True
    total, g = run()  # starts drawing: not the per-element draws, but the loop's gradient of them
    assert torch.isfinite(total) and torch.isfinite(g).all()
    reference = run("serial")
    for _ in range(2):
        got = run()
        torch.testing.assert_close(got[0], reference[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], reference[1])
