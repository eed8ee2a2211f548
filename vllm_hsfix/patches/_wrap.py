"""Wrapping and restoring attributes, with a marker so nothing is wrapped twice.

Wrappers are ``wrapt.FunctionWrapper`` objects: they keep ``__wrapped__``, the
signature, ``__name__`` and descriptor binding of the original (so a wrapped method
still binds to its instance and ``inspect`` still sees the original), and carry the
patch id in ``_self_vllm_hsfix`` so any later activation can recognise them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

MARKER = "_self_vllm_hsfix"

WrapperFn = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Replacement:
    """One attribute this package replaced, and what was there before."""

    owner: object
    name: str
    original: object

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)


def patch_id_of(obj: object) -> str | None:
    """The patch id carried by ``obj`` when it is one of our wrappers."""
    if isinstance(obj, wrapt.FunctionWrapper):
        return getattr(obj, MARKER, None)
    return None


def raw_attribute(owner: object, name: str) -> object:
    """The attribute as stored (class dict for classes, so methods stay unbound)."""
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name)


def wrap(owner: object, name: str, wrapper: WrapperFn, patch_id: str) -> Replacement | None:
    """Replace ``owner.name`` by ``wrapper`` around it; None if this patch is already there."""
    original = raw_attribute(owner, name)
    if patch_id_of(original) == patch_id:
        return None
    wrapped = wrapt.FunctionWrapper(original, wrapper)
    setattr(wrapped, MARKER, patch_id)
    setattr(owner, name, wrapped)
    return Replacement(owner, name, original)
