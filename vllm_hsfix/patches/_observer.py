"""The ``in-situ-verify`` extra (``patches.EXTRAS``): a pure observer that runs the
in-situ check when a worker registers its KV caches, on releases where no applied patch
runs it itself (0.17-0.23: the clamp only)."""

from __future__ import annotations

from typing import Any

from ._wrap import Replacement, wrap
from .hooks import ExtraContext, Hooks

OBSERVER_ID = "in-situ-verify"
ATTRIBUTE = "ExampleHiddenStatesConnector"


def _installed_observer(hooks: Hooks) -> Any:
    def register_kv_caches(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = wrapped(*args, **kwargs)
        hooks.after_register(instance)
        return result

    return register_kv_caches


def observe(module: object, ctx: ExtraContext) -> Replacement | None:
    """Wrap the connector's own ``register_kv_caches`` (None where it has none)."""
    cls = getattr(module, ATTRIBUTE, None)
    if not isinstance(cls, type) or "register_kv_caches" not in cls.__dict__:
        return None
    return wrap(cls, "register_kv_caches", _installed_observer(ctx.hooks), OBSERVER_ID)
