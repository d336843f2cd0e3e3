"""gradmap: a differentiable parallel map -- the chain rule for a multi-threaded map."""

from ._api import tmap as tmap
from ._executors import Executor as Executor
from ._executors import FuturesExecutor as FuturesExecutor
from ._executors import SerialExecutor as SerialExecutor
from ._executors import ThreadExecutor as ThreadExecutor
from ._ray import RayExecutor as RayExecutor

__version__ = "0.1.0"
