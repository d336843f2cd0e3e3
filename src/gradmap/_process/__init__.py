"""gradmap's worker processes: chunks run in other processes on this machine, past the GIL.

The rule is ``gradmap._remote`` (shared with Ray); this package is the local transport:
``_executor.py`` (``ProcessExecutor``), ``_workers.py`` (the processes and the calls in flight
to them), ``_transport.py`` (``ProcessTransport``: what a call sends, the caller as one more
worker), ``_worker.py`` and ``_host.py`` (a worker's side), ``_shared.py`` (tensors in shared
memory).
Nothing here starts a process until a map needs one.
"""

from __future__ import annotations

from ._executor import ProcessExecutor, default_executor

__all__ = ["ProcessExecutor", "default_executor"]
