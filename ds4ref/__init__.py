"""ds4ref: an exact, readable reference for serving DeepSeek V4 Flash (DS4)."""
from .model import DS4Model, load
from .scheduler.request import Request, Sampling

__all__ = ["load", "DS4Model", "Request", "Sampling", "Engine"]


def __getattr__(name):
    # The engine pulls in the scheduler; import it only when asked for.
    if name == "Engine":
        from .scheduler.engine import Engine
        return Engine
    raise AttributeError(name)
