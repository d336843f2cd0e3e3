"""``gradmap bench``: example workloads, timed with ``gradmap.tmap`` against the plain loop.

- ``gradmap.bench.workloads``: the workloads (readable as examples of what to map over).
- ``gradmap.bench.variants``: loop, ``tmap``, serial ``tmap`` and ``vmap`` ways to compute a loss.
- ``gradmap.bench.runner``: interleaved timing and gradient checks.
- ``gradmap.bench.report``: the table and the JSON record.
- ``gradmap.bench.plot``: speed-up against workers (needs ``gradmap[plot]``).
- ``gradmap.bench.cli``: the command line, ``main(argv)``.
"""

from gradmap.bench.workloads import WORKLOADS, Workload, get_workload

__all__ = ["WORKLOADS", "Workload", "get_workload"]
