"""Shared fixtures: the behaviour suite runs against every executor."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


EXECUTORS = ["serial", "threads", "threads-4", "user-pool"]


@pytest.fixture(params=EXECUTORS)
def tmap_kwargs(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``gradmap.tmap`` selecting one executor (chunks of 2, so that
    small maps still have several chunks)."""
    name = request.param
    if name == "serial":
        yield {"executor": "serial", "chunksize": 2}
    elif name == "threads":
        yield {"executor": "threads", "chunksize": 2}
    elif name == "threads-4":
        yield {"executor": None, "workers": 4, "chunksize": 1}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            yield {"executor": pool, "chunksize": 2}
