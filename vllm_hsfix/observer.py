"""The ``observer`` extra: one wrapper of the connector's ``register_kv_caches`` that
hands each registering worker to the runtime (provenance capture, in-situ checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .patches._wrap import Replacement, wrap

if TYPE_CHECKING:
    from .patches.hooks import ExtraContext

EXTRA_ID = "observer"


def wanted(ctx: ExtraContext) -> bool:
    """Wherever a patch is applied (its in-situ check) or provenance is on."""
    return bool(ctx.applied) or bool(ctx.config.provenance)


def install(module: object, ctx: ExtraContext) -> Replacement | None:
    """Wrap ``register_kv_caches`` where the connector class defines it (None if not)."""
    cls = getattr(module, "ExampleHiddenStatesConnector", None)
    if not isinstance(cls, type) or "register_kv_caches" not in cls.__dict__:
        return None

    def register_kv_caches(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        ctx.after_register(instance)
        return result

    return wrap(cls, "register_kv_caches", register_kv_caches, EXTRA_ID)
