"""The first step of every activation path, light enough for interpreter start: the
runtime loads only when vLLM is imported, or at once if it already is."""

from . import _lazy


def _start(trigger: str) -> None:
    from . import runtime

    runtime.start(trigger)


def activate(source: str) -> None:
    """Record ``source`` and patch now if vLLM is imported, else when it is."""
    _lazy.activate(source, _start)
