"""Shared fixtures: the behaviour suite runs against every executor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from support import EXECUTORS, SMALL_CHUNKS, executor_kwargs


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=EXECUTORS)
def tmap_kwargs(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``gradmap.tmap`` selecting one executor (chunks of 2, so that
    small maps still have several chunks)."""
    with executor_kwargs(request.param) as (kwargs, _):
        yield {**kwargs, "chunksize": SMALL_CHUNKS[request.param]}
