"""The ``gradmap`` command: ``gradmap demo``, ``gradmap bench`` and ``gradmap build``."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = """usage: gradmap {demo,bench,bench-jax,build} [options]

  demo       work that does not batch (trees): the loop vs tsum and tmap on threads and
             processes, speed-up, gradient difference, and which to use here
  bench      the benchmark workloads (gradmap bench --help)
  bench-jax  the ragged-bags workload in JAX: loops vs gradmap.jax.tmap (needs gradmap[jax])
  build      build the native graph walk now (else the first map builds it, about 20 s)
"""


def main(argv: list[str] | None = None) -> int:
    """Run ``gradmap <command>``; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from ._demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    if command == "bench-jax":
        from .bench.jax_bags import main as jax_main

        return int(jax_main(rest) or 0)
    if command == "build":
        if rest:
            print(
                "usage: gradmap build\n\n  Build the native graph walk now and print where it is "
                "cached (else the first map\n  builds it, about 20 s). It takes no options.",
                file=sys.stdout if rest[0] in ("-h", "--help") else sys.stderr,
            )
            return 0 if rest[0] in ("-h", "--help") else 2
        from ._torch._native import build

        print(f"gradmap: native graph walk ready: {build()}")
        return 0
    print(
        f"gradmap: unknown command {command!r}; expected one of ['bench', 'bench-jax', 'build', "
        "'demo']",
        file=sys.stderr,
    )
    return 2
