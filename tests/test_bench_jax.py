"""``gradmap bench-jax`` (``gradmap/bench/jax_bags.py``): the rows that say what gradmap costs
per element and what threads allow on the machine at all."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")


def test_own_cost_and_raw_threads_rows() -> None:
    from gradmap.bench import jax_bags

    results = jax_bags.run(n=6, reps=1, variants=("loop", "loop_vg", "tsum_serial", "raw"))
    for name in ("tsum_serial", "raw"):
        assert results[name]["max_rel_grad_diff"] < 1e-4  # both against the loop's gradient
        assert results[name]["cores_busy"] > 0
    table = jax_bags.format_results(results, 6)
    assert "gradmap's own cost per element: tsum_serial - loop_vg = " in table
    assert "what threads allow here (raw threads, no gradmap): " in table
