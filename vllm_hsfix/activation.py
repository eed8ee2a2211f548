"""The first step of every activation path, light enough for interpreter start.

``import vllm_hsfix``, the vLLM plugin and the sitecustomize bootstrap call
:func:`activate`. It imports only ``_lazy`` (which imports only what every interpreter
has loaded; no ``from __future__`` import here either, since ``__future__`` is a module
too): the runtime (and what it needs: the patch table, logging set-up, later wrapt,
packaging, metadata, the patches) loads only when vLLM is really imported, or at once
if it already is.
"""

from . import _lazy


def _start(trigger: str) -> None:
    from . import runtime

    runtime.start(trigger)


def activate(source: str) -> None:
    """Record ``source`` and patch now if vLLM is imported, else when it is."""
    _lazy.activate(source, _start)
