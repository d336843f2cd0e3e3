"""Random numbers in a map: each element draws from a seed of its own.

NOTE [random numbers per element]:
    PyTorch's default CPU generator is one object shared by every thread. ``f`` runs untouched, so
    its random calls draw from that generator; for the draws to depend on the element only (the
    same for every executor, worker count and run, under grad mode and ``no_grad``, and replayed
    exactly by a recompute), the generator is seeded with ``base + i`` right before element ``i``
    runs, where ``base`` is drawn once per map from the generator itself (so ``torch.manual_seed``
    makes a map reproducible, and two maps draw differently). After the map the generator is left
    as that one draw left it. Seeding costs about 1 us per element.

    Seeding a shared generator only works while one thread at a time runs elements: a forward in
    one thread (NOTE [forward placement] in ``_placement``) seeds, holding a process-wide lock so
    that maps called from several threads at once do not seed over each other. A forward spread
    over the pool does not seed; it is chosen only for an ``f`` that drew nothing in its first
    call (an ``f`` that draws on some elements only may be missed; its draws on the pool are then
    not reproducible, its gradients still right); a pass on the pool that moved the global
    generator (``f`` drew, or another thread of the process did) sends the next calls to one
    thread, seeded per element (``moved_by``). Whether a chunk drew is checked after its last
    element. A recompute (``remat=True``, ``create_graph=True``) of an ``f`` known to draw
    replays the seeds one chunk at a time under the lock; one whose results differ from the
    forward's is retried that way before it is called non-deterministic.

    The draws are not those of the plain loop, which draws from one stream across elements.
    CUDA generators are not seeded: GPU draws keep PyTorch's own behaviour.

    Seeding costs 1-1.5 us per element, most of a small element's own cost beside the walk, and
    most ``f`` draw nothing. So, as with the pool, a forward in one thread of an ``f`` seen to
    draw nothing in its first call (``Placement.seeds_each``) seeds the generator once for the
    whole pass, with ``base``, and checks after the pass whether anything drew (``each =
    False``): a check per chunk (reading the generator's 5 KB state and comparing) cost 4-5 us
    per element on molecules of 10-30 atoms in chunks of three (the seeding and checking once per
    chunk were a third of gradmap's own cost there). An ``f`` that starts drawing later
    (dropout after ``train()`` in a map of the same kind), or draws on elements the first call
    did not have, drew that call from the pass's seed on (right gradients, draws not the
    per-element ones), and is seeded per element from its next call on.
    ``executor="serial"`` and ``workers=1`` follow the same rule (with a history of their own);
    ``remat`` and worker processes seed every element always.

NOTE [the generator after a map]:
    Every map takes exactly one draw from the global generator (its seed base), whatever
    executor and placement run it and whether ``f`` draws: a forward in one thread draws the
    base on first use, a forward on the pool draws it before the pass (though it seeds
    nothing), and worker processes' driver draws it again after the pass (``draw_base`` in
    ``_remote/_host`` leaves the generator as it was, for the workers' seeds). So what a
    program draws after its maps (a shuffle for the next epoch) is the same from run to run:
    before, a map of an ``f`` that draws nothing took the draw when placement ran its forward in
    one thread and none when it ran on the pool, which depends on timing, and on processes
    none (three runs of one script: two shuffles after a threads map, and another after a
    processes map).

NOTE [random numbers of recomputes]:
    ``torch.utils.checkpoint`` (either kind) saves the generator's state when its forward runs
    and, to recompute in the backward, sets it back, draws (dropout) and restores the state it
    found, all on the one global generator (``torch.random.fork_rng``). In the loop nothing else
    draws meanwhile. On threads, chunks are pulled back while the forward of other chunks runs
    (``tsum``, a ``tmap`` of losses pulled back early) and on several threads at once: a
    recompute set the generator under a forward's dropout (the map's values off by 0.07, its
    gradients by 0.5, against the serial executor's, with a checkpointed dropout MLP) and two
    recomputes under each other (gradients not those of the values). So the forward in one
    thread (the only one that draws: NOTE [forward placement]) holds ``DRAWS`` while each
    element runs, and, on the first map that may use other threads, ``torch.random.fork_rng``
    is wrapped so that a chunk's forward or pullback holds it too for the block (other callers
    run the original). Recomputes then draw one at a time, between elements of the forward;
    the rest of each pullback still runs in parallel. A map called while ``DRAWS`` is held
    runs in its caller's thread (``alone``), so no chunk ever waits for a lock its own caller
    holds. Worker processes run one chunk at a time: nothing to guard there.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, nullcontext
from typing import Any, NoReturn, TypeVar

import torch

from .._engine import alone, on_a_chunk, working_on_a_chunk
from ._graph import in_a_pullback
from ._swaps import wrap_once

__all__ = ["DRAWS", "SEEDING", "MapRandom", "guard_rng_forks", "moved_by"]

SEEDING = threading.RLock()
os.register_at_fork(after_in_child=SEEDING._at_fork_reinit)  # type: ignore[attr-defined]
#: Held by whichever thread draws from the global generator for a map: the one-thread forward,
#: element by element, and a recompute's ``fork_rng`` block (NOTE [random numbers of recomputes]).
DRAWS = threading.RLock()
os.register_at_fork(after_in_child=DRAWS._at_fork_reinit)  # type: ignore[attr-defined]


def guard_rng_forks() -> None:
    """Wrap ``torch.random.fork_rng`` in ``DRAWS`` for chunks' threads, once per process
    (NOTE [random numbers of recomputes])."""
    wrap_once(torch.random, "fork_rng", _guarded_fork_rng)


def _guarded_fork_rng(original: Any) -> Any:
    @contextmanager
    @functools.wraps(original)
    def fork_rng(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if not (on_a_chunk() or in_a_pullback()):
            with original(*args, **kwargs) as value:
                yield value
            return
        with DRAWS, working_on_a_chunk(), alone(), original(*args, **kwargs) as value:
            yield value

    return fork_rng


def _position(state: torch.Tensor) -> torch.Tensor:
    # The CPU generator's state begins with its Mersenne twister's seed (8 bytes), then where it
    # is in its block of numbers (bytes 8-20): the same right after any seeding, moved by a draw.
    return state[8:20]


def _check_layout() -> bool:
    a = torch.Generator().manual_seed(1)
    b = torch.Generator().manual_seed(2)
    seeded = _position(a.get_state())
    torch.rand((), generator=b)
    return torch.equal(seeded, _position(torch.Generator().manual_seed(3).get_state())) and not (
        torch.equal(seeded, _position(b.get_state()))
    )


_SEEDED = _position(torch.Generator().manual_seed(0).get_state())
_LAYOUT_KNOWN = _check_layout()


def _drew_since_seeding(seed: int) -> bool:
    """Whether the global generator moved since it was seeded with ``seed`` (about 2 us)."""
    state = torch.default_generator.get_state()
    if _LAYOUT_KNOWN:
        return not torch.equal(_position(state), _SEEDED)
    return not torch.equal(state, torch.Generator().manual_seed(seed).get_state())


T = TypeVar("T")


def moved_by(run: Callable[[], T]) -> tuple[T, bool]:
    """``run()``, and whether the global generator moved meanwhile (about 4 us): a forward on
    the pool, which seeds nothing, learns so that ``f`` draws."""
    generator = torch.default_generator
    before = generator.get_state()
    out = run()
    return out, not torch.equal(before, generator.get_state())


class MapRandom:
    """The per-element seeds of one map."""

    def __init__(self) -> None:
        self.base: int | None = None
        self._after: torch.Tensor | None = None
        self.drew = False
        self.each = True  # seed every element; else the pass once (an f seen not to draw)
        #: The forward drew without a seed per element (NOTE [draws a recompute cannot replay])
        self.unseeded = False

    def draw_base(self) -> None:
        """Draw the map's base now if no forward in one thread has (a forward on the pool seeds
        nothing): every placement leaves the global generator one draw on (NOTE [the generator
        after a map])."""
        with nullcontext() if on_a_chunk() else SEEDING:
            if self._after is None:
                self.base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
                self._after = torch.default_generator.get_state()

    @contextmanager
    def seeding(self) -> Iterator[MapRandom]:
        """Around a forward in one thread: this map owns the global generator (a lock keeps
        other maps' seeding out), draws its base on first use, seeds the pass once unless each
        element is seeded (``each``), and leaves the generator as that one draw left it."""
        with nullcontext() if on_a_chunk() else SEEDING:  # nested: the outer map holds it
            gen = torch.default_generator
            if self._after is None:
                self.base = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
                self._after = gen.get_state()
            after = self._after
            once = not self.each  # an f seen not to draw: one seed for the whole pass
            if once:
                assert self.base is not None
                gen.manual_seed(self.base)
            try:
                yield self
            finally:
                if once and not self.drew:
                    assert self.base is not None
                    self.drew = _drew_since_seeding(self.base)
                gen.set_state(after)

    def learned(self, placement: Any) -> None:
        """After a forward in one thread: tell ``placement`` whether ``f`` drew, and note draws
        made without a seed per element."""
        placement.learned_random(self.drew)
        if self.drew and not self.each:
            self.unseeded = True

    def cannot_replay(self, api: str) -> NoReturn:
        """Raise for a recompute of a forward whose draws were not seeded per element.

        NOTE [draws a recompute cannot replay]:
            A forward on the pool seeds nothing, and one in one thread of an ``f`` seen to draw
            nothing in its first call seeds the pass once (NOTE [random numbers per element]).
            When such an ``f`` draws after all (its first call ran a ``Dropout`` in ``eval()``
            mode, this one in ``train()``), the map's gradients are right, but a recompute
            (``remat=True``, a ``create_graph=True`` backward) cannot replay the draws: it
            gave other results, and the error said ``f`` must be deterministic, which it is
            (a helper's case: the loop works there). The error now says what happened; the
            map learnt that ``f`` draws, and its next map seeds every element."""
        raise RuntimeError(
            f"{api}: f drew random numbers in this map, which gradmap did not seed element by "
            "element: an earlier map of the same f drew none (a module in eval() mode then, "
            "such as Dropout, now in train() mode; or draws on some elements only), so this "
            "map ran f as one that draws nothing, and its recompute (remat=True, or a "
            "create_graph=True backward) cannot replay the draws. gradmap has learnt that f "
            "draws: from the next map of f on every element is seeded and replayed. Run this "
            "map again, or use remat=False and no create_graph for it."
        )

    def element(self, index: int) -> None:
        """Seed the global generator for element ``index`` (inside ``seeding``)."""
        assert self.base is not None
        torch.default_generator.manual_seed(self.base + index)

    def check_chunk(self, last: int) -> None:
        """Record whether the chunk whose last seeded element is ``last`` drew anything since."""
        if not self.drew:
            assert self.base is not None
            self.drew = _drew_since_seeding(self.base + last)

    def replaying(self, seeded: bool) -> ContextManager[MapRandom | None]:
        """The context of a recompute: with ``seeded`` (or if ``f`` is known to draw), the lock
        (one recompute at a time) and ``self`` to seed each element with, the generator
        restored after."""
        if not (seeded or self.drew) or self.base is None:
            return nullcontext()
        return self._replay()

    @contextmanager
    def _replay(self) -> Iterator[MapRandom]:
        with SEEDING:
            saved = torch.default_generator.get_state()
            try:
                yield self
            finally:
                torch.default_generator.set_state(saved)
