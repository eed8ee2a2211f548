"""vllm-hsfix: correct hidden-state extraction on pinned vLLM releases (0.17 on).

Importing it activates it: patches go in when vLLM's targets are imported. No
``from __future__`` import in the start-up modules: ``__future__`` is a module too.
"""

from ._version import __version__
from .errors import HsfixError

__all__ = ["HsfixError", "__version__", "apply", "status", "unapply"]


def apply() -> None:
    """Activate (idempotent): patch now if vLLM's targets are imported, else on import.
    Also the way back after :func:`unapply` or a reload of a target."""
    from . import runtime

    runtime.start("apply")


def unapply() -> None:
    """Stop patching in this process: every original comes back (beneath a later
    wrapper, ours passes through). Only :func:`apply` patches again."""
    from . import runtime

    runtime.unapply()


def status() -> dict[str, object]:
    """This process's state, checked against the live targets: vLLM found, each
    patch's status, code and reason, the activation paths."""
    from . import runtime

    return runtime.status()


def _activate_on_import() -> None:
    import sys

    # Who imports us when not the user (the bootstrap, vLLM's plugin loader) says so here.
    source = sys.modules.pop("_vllm_hsfix_activating", None)
    from .activation import activate

    activate(source if isinstance(source, str) else "import")


_activate_on_import()
