"""gradmap on Ray: chunks run on Ray actors, in other processes or on other machines.

``RayExecutor`` imports without Ray (it says how to install Ray when it is missing). The rule is
``gradmap._remote`` (shared with the local worker processes); this package is Ray's transport:
``_transport.py`` (calls to the actors, the actor class), ``_pool.py`` (the actors) and
``_cluster.py`` (starting Ray on loopback, or connecting to a cluster).
"""

from __future__ import annotations

from ._executor import RayExecutor

__all__ = ["RayExecutor"]
