"""The JAX adapter: ``gradmap.jax.tmap`` and ``gradmap.jax.tsum``.

| module | one concept |
|---|---|
| ``_mode`` | which JAX transformation is active, and so which of the three ways the map runs |
| ``_config`` | JAX's thread-local configuration carried into the workers |
| ``_items`` | the zip of the iterables, arrays split over their first dimension |
| ``_chunks`` | what a chunk does around each element: stop early, wait for its arrays |
| ``_closure`` | what ``f`` closes over: the key its traces are reused under across calls |
| ``_element`` | elements under reverse mode: traced (cached), the tracers they use hoisted, run |
| ``_compiled`` | an element as compiled programs: forward, pullback, value and gradient, sum step |
| ``_rule`` | ``tmap``'s rule: chunked forward, a join node, per-chunk pullbacks, fixed-order sum |
| ``_sum`` | ``tsum``'s rule: each element one compiled step, chunks' gradients summed in order |
| ``_map`` | ``tmap`` and ``tsum``: argument checks and the choice between eager, rule and loop |

Nothing here is imported by ``import gradmap``; ``import gradmap.jax`` imports JAX, and no
PyTorch.
"""
