"""``gradmap.jax``: the differentiable parallel map for JAX (``pip install 'gradmap[jax]'``)."""

from ._jax._map import tmap as tmap
from ._jax._map import tsum as tsum
