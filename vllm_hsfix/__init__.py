"""vllm-hsfix: backport of vLLM PR 46301 to pinned vLLM 0.17.0-0.24.x.

Importing this package activates it: the patches are applied when vLLM's target
modules are imported (or at once if they already are). Importing it costs almost
nothing where vLLM is never used: nothing heavy loads until ``vllm`` is imported.

Public API: :func:`apply`, :func:`unapply`, :func:`status`, ``__version__``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "apply", "status", "unapply"]


def apply() -> None:
    """Activate (idempotent). Patches now if vLLM's targets are imported, else on import."""
    from . import activation

    activation.start("apply")


def unapply() -> None:
    """Restore every original vLLM object exactly and stop patching in this process."""
    from . import activation

    activation.unapply()


def status() -> dict[str, object]:
    """Structured state: vLLM found, each patch's status and reason, activation paths."""
    from . import activation

    return activation.status()


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
    from ._lazy import activate

    activate(source)


_activate_on_import()
