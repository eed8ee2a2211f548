"""vllm-hsfix: correct hidden-state extraction on pinned vLLM releases (0.17-0.33).

Importing this package activates it: the patches are applied when vLLM's target
modules are imported (or at once if they already are). Importing it costs almost
nothing where vLLM is never used: nothing heavy loads until ``vllm`` is imported.

Public API: :func:`apply`, :func:`unapply`, :func:`status`, ``__version__``.

No ``from __future__ import annotations`` here or in the other start-up modules:
``__future__`` is a module that ``site`` does not load, and ``tests/test_import_cost.py``
lists every module this import may add.
"""

from ._version import __version__
from .errors import HsfixError

__all__ = ["HsfixError", "__version__", "apply", "status", "unapply"]


def apply() -> None:
    """Activate (idempotent). Patches now if vLLM's targets are imported, else on import.
    Also the way back after :func:`unapply`, and the repair after a target was reloaded."""
    from . import runtime

    runtime.start("apply")


def unapply() -> None:
    """Stop patching in this process: every original comes back (or, beneath a wrapper
    added later by someone else, ours passes straight through). Sticks: the plugin, the
    import watcher and the bootstrap do not patch again; only :func:`apply` does."""
    from . import runtime

    runtime.unapply()


def status() -> dict[str, object]:
    """Structured state: vLLM found, each patch's status and reason, activation paths.
    Checked against the live targets each time it is called."""
    from . import runtime

    return runtime.status()


def _loaded_as_entry_point() -> bool:
    """Whether this import comes from an entry point's ``load()`` (vLLM's plugin loader):
    then the plugin function records the activation itself, as "plugin"."""
    import sys

    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return False
        code = frame.f_code
        if (
            code.co_name == "load"
            and "importlib" in code.co_filename
            and "metadata" in (code.co_filename)
        ):
            return True
        frame = frame.f_back
    return False


def _activate_on_import() -> None:
    import sys

    # The sitecustomize bootstrap leaves this marker so its import is recorded as itself.
    if sys.modules.pop("_vllm_hsfix_bootstrapping", None):
        source = "bootstrap"
    elif _loaded_as_entry_point():
        return
    else:
        source = "import"
    from .activation import activate

    activate(source)


_activate_on_import()
