"""Benchmark workloads: per-element losses of the kinds users map over.

Each workload is a small class whose ``make(seed, n)`` builds deterministic data and a model, and
whose ``f(item)`` is the per-element function a user would write: it returns a 0-d loss tensor.
The total loss is the sum of ``f`` over ``items``; its gradient goes to ``params()``. Read them as
examples of what ``gradmap.tmap(workload.f, workload.items)`` is for:

- ``ragged_bags`` (coarse): bags of 5-200 instances through a shared MLP, mean per bag.
- ``small_bags`` (fine): bags of 1-8 instances through a tiny MLP; Python overhead dominates.
- ``tree``: a recursive network over random binary trees (Python control flow, no vmap).
- ``ode``: fixed-step RK4 of a neural ODE with a per-sample number of steps.
- ``gru``: one recurrent layer per sequence: a few large ops per element (GIL-free forward).
- ``overhead``: ``x * 2`` on 0-d tensors; measures the per-element cost of the map itself.

Bags also have ``batched_loss(items)``: the same total loss computed with ``torch.func.vmap`` over a
padded and masked batch, the usual alternative to a map when the elements can be padded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, Union

import torch
from torch import Tensor, nn

__all__ = [
    "WORKLOADS",
    "Bag",
    "MessagePassing",
    "ModelWorkload",
    "Molecule",
    "Molecules",
    "NeuralODE",
    "ODESample",
    "Overhead",
    "RaggedBags",
    "Sequences",
    "SmallBags",
    "Tree",
    "TreeNet",
    "TreeSample",
    "VectorField",
    "Workload",
    "get_workload",
    "mlp",
    "pad_bags",
    "random_tree_shape",
    "rk4",
]

ItemT = TypeVar("ItemT")
ModuleT = TypeVar("ModuleT", bound=nn.Module)


class Workload(ABC, Generic[ItemT]):
    """A per-element differentiable function with its data.

    Subclasses set the class attributes and implement ``make``, ``f`` and ``params``. A workload
    with a padded formulation sets ``has_batched = True`` and implements ``batched_loss``.

    Attributes:
        name: Short identifier used on the command line.
        summary: One line describing the workload.
        default_n: Number of elements of a full run.
        quick_n: Number of elements of a ``--quick`` run.
        has_batched: Whether ``batched_loss`` is available.
        items: The elements to map over.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    default_n: ClassVar[int]
    quick_n: ClassVar[int]
    has_batched: ClassVar[bool] = False

    items: list[ItemT]

    @classmethod
    @abstractmethod
    def make(cls, seed: int, n: int) -> Workload[ItemT]:
        """Build the data and the model.

        Arguments:
            seed: Seed of the ``torch.Generator`` for the data and of the model's initialisation;
                the same seed gives the same workload.
            n: Number of elements.

        Returns:
            The workload, ready to map over.
        """

    @abstractmethod
    def f(self, item: ItemT) -> Tensor:
        """Compute the loss of one element.

        Arguments:
            item: One element of ``items``.

        Returns:
            A 0-d loss tensor.
        """

    @abstractmethod
    def params(self) -> list[Tensor]:
        """Return the tensors the total loss is differentiated with respect to."""

    def __getstate__(self) -> dict[str, Any]:
        """The workload as ``f`` (a bound method) is pickled for worker processes: its model,
        without its items, which ``f`` does not use and which travel as the map's items. (The
        same advice holds for users: keep the data out of what ``f`` refers to.)"""
        state = dict(self.__dict__)
        state.pop("items", None)
        return state

    def batched_loss(self, items: Sequence[ItemT]) -> Tensor:
        """Compute the total loss over ``items`` as one batched computation.

        Arguments:
            items: The elements.

        Returns:
            A 0-d tensor equal (up to rounding) to the sum of ``f`` over ``items``.

        Raises:
            NotImplementedError: The workload has no batched formulation.
        """
        raise NotImplementedError(f"workload {self.name!r} has no batched formulation")


class ModelWorkload(Workload[ItemT]):
    """A workload whose parameters are those of the one module, ``model``, that ``f`` runs;
    its items are drawn one after another from one generator (``draw``), its module built by
    ``build`` under the seed."""

    def __init__(self, model: nn.Module, items: list[ItemT]) -> None:
        self.model = model
        self.items = items

    @classmethod
    def make(cls, seed: int, n: int) -> ModelWorkload[ItemT]:
        gen = torch.Generator().manual_seed(seed)
        items = [cls.draw(gen) for _ in range(n)]
        return cls(seeded_module(seed, cls.build), items)

    @classmethod
    @abstractmethod
    def draw(cls, gen: torch.Generator) -> ItemT:
        """One item, drawn from ``gen``."""

    @classmethod
    @abstractmethod
    def build(cls) -> nn.Module:
        """The module (its initialisation is drawn from the workload's seed)."""

    def params(self) -> list[Tensor]:
        return list(self.model.parameters())


def seeded_module(seed: int, build: Callable[[], ModuleT]) -> ModuleT:
    """Build a module with its default initialisation drawn from ``seed``.

    The global RNG state is restored afterwards.

    Arguments:
        seed: Seed for the initialisation.
        build: Function constructing the module.

    Returns:
        The module.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def randint(low: int, high: int, gen: torch.Generator) -> int:
    """Draw one integer uniformly from ``low..high`` (both included)."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Build a multi-layer perceptron with ReLU between its linear layers.

    Arguments:
        sizes: Layer widths, input first, e.g. ``(64, 128, 128, 1)``.

    Returns:
        The network.
    """
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------------------------
# Bags (multiple-instance regression)


class Bag(NamedTuple):
    """One bag: ``x`` holds the instances (rows), ``y`` the bag's 0-d target."""

    x: Tensor
    y: Tensor


def pad_bags(bags: Sequence[Bag]) -> tuple[Tensor, Tensor, Tensor]:
    """Pad bags of different sizes into one batch.

    Arguments:
        bags: The bags.

    Returns:
        ``(x, mask, y)``: instances of shape ``(B, L, features)`` padded with zeros to the
        largest bag, a float mask of shape ``(B, L)`` with 1 for real instances, and targets of
        shape ``(B,)``.
    """
    x = nn.utils.rnn.pad_sequence([bag.x for bag in bags], batch_first=True)
    lengths = torch.tensor([len(bag.x) for bag in bags])
    mask = (torch.arange(x.shape[1]) < lengths[:, None]).to(x.dtype)
    y = torch.stack([bag.y for bag in bags])
    return x, mask, y


class _Bags(ModelWorkload[Bag]):
    """Bags of instances through a shared MLP; a bag's prediction is the mean over its instances.

    The loss of a bag is the squared error of that mean against the bag's target.
    """

    min_size: ClassVar[int]
    max_size: ClassVar[int]
    sizes: ClassVar[tuple[int, ...]]
    has_batched = True

    @classmethod
    def draw(cls, gen: torch.Generator) -> Bag:
        size = randint(cls.min_size, cls.max_size, gen)
        return Bag(torch.randn(size, cls.sizes[0], generator=gen), torch.randn((), generator=gen))

    @classmethod
    def build(cls) -> nn.Module:
        return mlp(cls.sizes)

    def f(self, item: Bag) -> Tensor:
        prediction = self.model(item.x).mean()
        return (prediction - item.y) ** 2

    def batched_loss(self, items: Sequence[Bag]) -> Tensor:
        x, mask, y = pad_bags(items)

        def one_bag(x: Tensor, mask: Tensor, y: Tensor) -> Tensor:
            prediction = (self.model(x).squeeze(-1) * mask).sum() / mask.sum()
            return (prediction - y) ** 2

        return torch.func.vmap(one_bag)(x, mask, y).sum()


class RaggedBags(_Bags):
    """Coarse elements: bags of 5-200 instances x 64 features, MLP 64-128-128-1."""

    name = "ragged_bags"
    summary = "bags of 5-200 x 64, MLP 64-128-128-1, mean per bag (coarse)"
    default_n, quick_n = 256, 32
    min_size, max_size = 5, 200
    sizes = (64, 128, 128, 1)


class SmallBags(_Bags):
    """Fine elements: bags of 1-8 instances x 16 features, MLP 16-32-1."""

    name = "small_bags"
    summary = "bags of 1-8 x 16, MLP 16-32-1, mean per bag (fine)"
    default_n, quick_n = 2048, 256
    min_size, max_size = 1, 8
    sizes = (16, 32, 1)


# --------------------------------------------------------------------------------------------
# Tree network (recursive, Python control flow)

TreeShape = Union[int, tuple["TreeShape", "TreeShape"]]  # noqa: UP007 (recursive alias)
"""A binary tree: a leaf is the index of its feature row, an internal node a pair of subtrees."""


class TreeSample(NamedTuple):
    """One tree: leaf features of shape ``(leaves, features)``, its shape and a 0-d target."""

    leaves: Tensor
    shape: TreeShape
    y: Tensor


def random_tree_shape(n_leaves: int, gen: torch.Generator, first: int = 0) -> TreeShape:
    """Draw a random full binary tree by splitting the leaves at a uniform point, recursively.

    Arguments:
        n_leaves: Number of leaves (at least 1); the tree has ``2 * n_leaves - 1`` nodes.
        gen: Random generator.
        first: Index of the leftmost leaf.

    Returns:
        The tree's shape, with leaves numbered ``first .. first + n_leaves - 1`` left to right.
    """
    if n_leaves == 1:
        return first
    n_left = randint(1, n_leaves - 1, gen)
    return (
        random_tree_shape(n_left, gen, first),
        random_tree_shape(n_leaves - n_left, gen, first + n_left),
    )


class TreeNet(nn.Module):
    """Recursive network: leaves embed their features, internal nodes combine their children.

    Arguments:
        features: Width of a leaf's feature vector.
        hidden: Width of a node's embedding.
    """

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.leaf = nn.Linear(features, hidden)
        self.combine = nn.Linear(2 * hidden, hidden)
        self.readout = nn.Linear(hidden, 1)

    def embed(self, leaves: Tensor, shape: TreeShape) -> Tensor:
        """Embed the subtree ``shape``; returns a vector of width ``hidden``."""
        if isinstance(shape, int):
            return self.leaf(leaves[shape])
        left, right = shape
        children = torch.cat((self.embed(leaves, left), self.embed(leaves, right)))
        return torch.tanh(self.combine(children))

    def forward(self, leaves: Tensor, shape: TreeShape) -> Tensor:
        """Return the tree's 0-d output."""
        return self.readout(self.embed(leaves, shape)).squeeze(-1)


class Tree(ModelWorkload[TreeSample]):
    """Random binary trees of 5-59 nodes (3-30 leaves, 16 features), regression at the root."""

    name = "tree"
    summary = "recursive net over random binary trees of 5-59 nodes, hidden 64"
    default_n, quick_n = 256, 32
    features, hidden = 16, 64

    @classmethod
    def draw(cls, gen: torch.Generator) -> TreeSample:
        n_leaves = randint(3, 30, gen)
        return TreeSample(
            torch.randn(n_leaves, cls.features, generator=gen),
            random_tree_shape(n_leaves, gen),
            torch.randn((), generator=gen),
        )

    @classmethod
    def build(cls) -> nn.Module:
        return TreeNet(cls.features, cls.hidden)

    def f(self, item: TreeSample) -> Tensor:
        return (self.model(item.leaves, item.shape) - item.y) ** 2


# --------------------------------------------------------------------------------------------
# Neural ODE with a per-sample number of steps


class ODESample(NamedTuple):
    """One initial state ``y0`` and the number of RK4 steps to integrate it over ``[0, 1]``."""

    y0: Tensor
    steps: int


class VectorField(nn.Module):
    """Autonomous vector field ``dy/dt = W2 tanh(W1 y + b1) + b2``.

    Arguments:
        dim: State dimension.
        hidden: Hidden width.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim))

    def forward(self, y: Tensor) -> Tensor:
        """Return ``dy/dt`` at state ``y``."""
        return self.net(y)


def rk4(field: Callable[[Tensor], Tensor], y0: Tensor, t1: float, steps: int) -> Tensor:
    """Integrate ``dy/dt = field(y)`` from 0 to ``t1`` with the classical Runge-Kutta method.

    Arguments:
        field: The vector field.
        y0: Initial state.
        t1: End time.
        steps: Number of equal steps.

    Returns:
        The state at ``t1``.
    """
    h = t1 / steps
    y = y0
    for _ in range(steps):
        k1 = field(y)
        k2 = field(y + h / 2 * k1)
        k3 = field(y + h / 2 * k2)
        k4 = field(y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return y


class NeuralODE(ModelWorkload[ODESample]):
    """States of width 16 integrated over ``[0, 1]`` with 10-60 RK4 steps; loss ``|y(1)|^2``."""

    name = "ode"
    summary = "RK4 of a neural ODE (dim 16, hidden 64), 10-60 steps per sample"
    default_n, quick_n = 128, 12
    dim, hidden = 16, 64  # state width, field width

    @classmethod
    def draw(cls, gen: torch.Generator) -> ODESample:
        return ODESample(torch.randn(cls.dim, generator=gen), randint(10, 60, gen))

    @classmethod
    def build(cls) -> nn.Module:
        return VectorField(cls.dim, cls.hidden)

    def f(self, item: ODESample) -> Tensor:
        return rk4(self.model, item.y0, 1.0, item.steps).pow(2).sum()


# --------------------------------------------------------------------------------------------
# Message passing on molecules


class Molecule(NamedTuple):
    """One molecule: atom types ``z`` (``(atoms,)``, int64), bonds in both directions
    ``edges`` (``(2, 2 * bonds)``, int64) and a 0-d target ``y``."""

    z: Tensor
    edges: Tensor
    y: Tensor


class MessagePassing(nn.Module):
    """Atom-type embeddings, rounds of messages (an MLP of both ends of each bond, summed at the
    receiving atom with ``index_add``) with a GRU cell update, and a readout summed over atoms.

    Arguments:
        types: Number of atom types.
        hidden: Width of an atom's state.
        rounds: Rounds of message passing.
    """

    def __init__(self, types: int, hidden: int, rounds: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(types, hidden)
        self.messages = nn.ModuleList(mlp((2 * hidden, hidden, hidden)) for _ in range(rounds))
        self.updates = nn.ModuleList(nn.GRUCell(hidden, hidden) for _ in range(rounds))
        self.readout = mlp((hidden, hidden, 1))

    def forward(self, z: Tensor, edges: Tensor) -> Tensor:
        """Return the molecule's 0-d output."""
        h = self.embed(z)
        source, target = edges
        for message, update in zip(self.messages, self.updates):
            m = message(torch.cat((h[source], h[target]), dim=-1))
            h = update(torch.zeros_like(h).index_add_(0, target, m), h)
        return self.readout(h).sum()


class Molecules(ModelWorkload[Molecule]):
    """Random molecules of 8-40 atoms (10 types, about 1.5 bonds per atom), three rounds of
    message passing (hidden 64, about 120k parameters), regression of a 0-d target."""

    name = "molecules"
    summary = "message passing on molecules of 8-40 atoms, 3 rounds, hidden 64 (120k params)"
    default_n, quick_n = 128, 16
    types, hidden, rounds = 10, 64, 3

    @classmethod
    def draw(cls, gen: torch.Generator) -> Molecule:
        atoms = randint(8, 40, gen)
        z = torch.randint(0, cls.types, (atoms,), generator=gen)
        # a chain keeps the molecule connected; about half as many bonds again close rings
        extra = atoms // 2
        a = torch.cat((torch.arange(atoms - 1), torch.randint(0, atoms, (extra,), generator=gen)))
        b = torch.cat((torch.arange(1, atoms), torch.randint(0, atoms, (extra,), generator=gen)))
        edges = torch.stack((torch.cat((a, b)), torch.cat((b, a))))
        return Molecule(z, edges, torch.randn((), generator=gen))

    @classmethod
    def build(cls) -> nn.Module:
        return MessagePassing(cls.types, cls.hidden, cls.rounds)

    def f(self, item: Molecule) -> Tensor:
        return (self.model(item.z, item.edges) - item.y) ** 2


# --------------------------------------------------------------------------------------------
# Large ops per element


class Sequences(ModelWorkload[Tensor]):
    """Sequences of 20-120 steps of width 32 through one GRU layer (hidden 128); loss: the mean of
    the last hidden state squared. Each element is a few large ops that release the GIL."""

    name = "gru"
    summary = "one GRU layer (32 -> 128) per sequence of 20-120 steps: large ops per element"
    default_n, quick_n = 64, 8
    dim, hidden = 32, 128
    steps = (20, 120)  # the shortest and the longest sequence

    @classmethod
    def draw(cls, gen: torch.Generator) -> Tensor:
        return torch.randn(randint(*cls.steps, gen), cls.dim, generator=gen)

    @classmethod
    def build(cls) -> nn.Module:
        return nn.GRU(cls.dim, cls.hidden)

    def f(self, item: Tensor) -> Tensor:
        _, last = self.model(item)
        return last.pow(2).mean()


# --------------------------------------------------------------------------------------------
# Overhead of the map itself


class Overhead(Workload[Tensor]):
    """A trivial ``f(x) = x * 2`` on 0-d leaf tensors; the gradient goes to the items themselves.

    Its per-element time is almost all the map's own cost (hand-off, graph bookkeeping).
    """

    name = "overhead"
    summary = "f(x) = x * 2 on 0-d leaf tensors (per-element cost of the map)"
    default_n = 10_000
    quick_n = 2_000

    def __init__(self, items: list[Tensor]) -> None:
        self.items = items

    @classmethod
    def make(cls, seed: int, n: int) -> Overhead:
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn(n, generator=gen)
        return cls([x.clone().requires_grad_() for x in values.unbind()])

    def f(self, item: Tensor) -> Tensor:
        return item * 2

    def params(self) -> list[Tensor]:
        return self.items


WORKLOADS: dict[str, type[Workload[Any]]] = {
    w.name: w for w in (RaggedBags, SmallBags, Tree, NeuralODE, Molecules, Sequences, Overhead)
}
"""All workloads by name, in the order the bench runs them."""


def get_workload(name: str) -> type[Workload[Any]]:
    """Look a workload class up by name.

    Arguments:
        name: One of ``WORKLOADS``.

    Returns:
        The workload class.

    Raises:
        KeyError: Unknown name; the message lists the known ones.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
