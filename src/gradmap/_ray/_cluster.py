"""Connecting to Ray: an existing connection, a cluster's address, or a local instance on loopback.

NOTE [a local Ray on loopback]:
    When nothing is connected and no address is given (neither ``address=`` nor ``RAY_ADDRESS``),
    gradmap starts a local instance for this process: ``ray.init(address="local", num_cpus=<the
    cores available to the process>, include_dashboard=False)``. ``address="local"`` makes a new
    instance even when another one runs on the machine (a plain ``ray.init()`` would join the last
    cluster started there, someone else's on a shared machine). Ray's servers (GCS, raylet, object
    manager, workers) listen on the node's address, which for a non-loopback address means every
    interface; gradmap asks for ``127.0.0.1``. ``_node_ip_address="127.0.0.1"`` alone is not
    enough on Linux: Ray replaces a loopback address by the machine's outward address unless its
    ``ENABLE_RAY_CLUSTER`` switch is off, which gradmap turns off for the duration of the call
    (measured with Ray 2.60: with it, nothing listens outside loopback). Ray's own token
    authentication stays on.

    To use a cluster instead: start it (``ray start --head`` on one node, ``ray start
    --address=...`` on the others, each with gradmap and the same torch installed) and pass
    ``RayExecutor(address="auto")`` (or the head's address, or ``ray://host:10001``), or set
    ``RAY_ADDRESS``, or call ``ray.init(...)`` yourself before the first map: a connection made
    before gradmap needs one is used as it is.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from .._executors import available_cores

__all__ = ["RAY_MISSING", "ensure_connected", "import_ray", "ray_installed"]

RAY_MISSING = (
    "gradmap's Ray executor needs Ray, which is not installed: pip install 'gradmap[ray]' "
    "(or pip install ray)"
)


def ray_installed() -> bool:
    """Whether Ray can be imported (without importing it)."""
    return importlib.util.find_spec("ray") is not None


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(RAY_MISSING) from exc
    return ray


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    try:
        from ray._private import ray_constants
    except ImportError:  # pragma: no cover - a Ray without the switch
        yield
        return
    previous = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if previous is None:  # pragma: no cover - a Ray without the switch
        yield
        return
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous


def ensure_connected(address: str | None, init_kwargs: dict[str, Any] | None) -> Any:
    """Connect this process to Ray if it is not yet (see NOTE [a local Ray on loopback]).

    Arguments:
        address: a cluster's address (``"auto"``, ``"host:port"``, ``"ray://host:port"``), or
            ``None`` for ``RAY_ADDRESS`` if set, else a local instance on loopback.
        init_kwargs: more keyword arguments for ``ray.init`` (they override gradmap's own).

    Returns:
        The ``ray`` module, connected.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"log_to_driver": True}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        kwargs.update(
            address="local",
            num_cpus=available_cores(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
        kwargs.update(init_kwargs or {})
        with _loopback_only():
            ray.init(**kwargs)
    else:
        if address is not None:
            kwargs["address"] = address
        kwargs.update(init_kwargs or {})
        ray.init(**kwargs)
    return ray
