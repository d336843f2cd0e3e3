"""The rule for chunks in other processes, whatever carries the calls: ``_map.py`` (the driver's
side: the join node, passes over the workers), ``_host.py`` (the worker's side: chunk records,
by call), ``_pickling.py`` (tensors travel as identities), ``_schedule.py`` (a pass over the
workers, lost workers, and the ``Transport`` that Ray and the local processes implement)."""
