"""Shared fixtures: the behaviour suite runs against every executor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from support import EXECUTORS, SMALL_CHUNKS, executor_kwargs, native_walk, python_walk


@pytest.fixture(autouse=True, scope="session")
def _native_walk_built() -> None:
    """Build the native walk (about 25 s, once per machine) before any test's deadline runs."""
    native_walk()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=EXECUTORS)
def tmap_kwargs(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``gradmap.tmap`` selecting one executor (chunks of 2, so that
    small maps still have several chunks)."""
    with executor_kwargs(request.param) as (kwargs, _):
        yield {**kwargs, "chunksize": SMALL_CHUNKS[request.param]}


@pytest.fixture(params=["native", "python"])
def both_walks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run the test with the native boundary walk and with the Python one (its fallback); a
    module takes it with ``pytestmark = pytest.mark.usefixtures("both_walks")``."""
    if request.param == "python":
        with python_walk():  # (skips on a free-threaded interpreter)
            yield
    elif not native_walk():
        pytest.skip("the native walk cannot be built here")
    else:
        yield
