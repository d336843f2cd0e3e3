"""The JAX adapter: ``gradmap.jax.tmap``.

| module | one concept |
|---|---|
| ``_mode`` | which JAX transformation is active, and so which of the three ways the map runs |
| ``_config`` | JAX's thread-local configuration carried into the workers |
| ``_items`` | the zip of the iterables, arrays split over their first dimension |
| ``_chunks`` | what a chunk does around each element: stop early, wait for its arrays |
| ``_element`` | elements under reverse mode: traced, the tracers they use hoisted, run |
| ``_compiled`` | an element that is one jitted call: compiled forward and pullback, cached |
| ``_rule`` | the rule: forward in chunks, one join node, per-chunk pullbacks, a fixed-order sum |
| ``_map`` | ``tmap``: argument checks and the choice between eager, rule and loop |

Nothing here is imported by ``import gradmap``; ``import gradmap.jax`` imports JAX.
"""
