"""Wrapping and restoring attributes: recognisable, switchable, polite to others.

:class:`HsfixWrapper` (a ``wrapt.FunctionWrapper``) carries the patch id and a switch.
Reverting turns the switch off and puts the original back only where ours is still
outermost (as ddtrace and OpenTelemetry do); :func:`add` defines a missing method.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

log = logging.getLogger(__name__)

WrapperFn = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _Absent:
    """The ``original`` of an attribute this package added: there was none."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT: Any = _Absent()


class _HsfixBound(wrapt.BoundFunctionWrapper):  # type: ignore[misc]
    """What our wrapper of a plain function turns into when read from a class or an
    instance. Only the call through the class with an explicit first argument differs
    from wrapt: that argument is the instance, whatever its type (as in Python)."""

    def __call__(*args: Any, **kwargs: Any) -> Any:
        self, args = args[0], args[1:]  # a keyword argument named "self" stays a keyword
        if self._self_binding == "function" and self._self_instance is None and args:
            instance, rest = args[0], args[1:]
            bound = wrapt.PartialCallableObjectProxy(self.__wrapped__, instance)
            return self._self_wrapper(bound, instance, rest, kwargs)
        return wrapt.BoundFunctionWrapper.__call__(self, *args, **kwargs)


class HsfixWrapper(wrapt.FunctionWrapper):  # type: ignore[misc]
    """Our wrapper, identified by exact type (wrapt proxies forward ``isinstance``).
    ``added``: switched off, a call raises ``AttributeError``, as the release would."""

    __bound_function_wrapper__ = _HsfixBound

    def __init__(
        self, wrapped: Any, wrapper: WrapperFn, patch_id: str, added: str | None = None
    ) -> None:
        def call(fn: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            if not self._self_hsfix_on:
                if added is not None:
                    raise AttributeError(
                        f"{added}: added by vllm-hsfix ({patch_id}), which was reverted"
                    )
                return fn(*args, **kwargs)
            return wrapper(fn, instance, args, kwargs)

        super().__init__(wrapped, call)
        self._self_hsfix_patch = patch_id
        self._self_hsfix_on = True

    @property
    def hsfix_patch(self) -> str:
        return str(self._self_hsfix_patch)

    @property
    def hsfix_active(self) -> bool:
        return bool(self._self_hsfix_on)

    def hsfix_set_active(self, on: bool) -> None:
        self._self_hsfix_on = on


def ours_in(obj: object, patch_id: str | None = None) -> Any:
    """Our wrapper (or swapped function, see :func:`swap`) in ``obj``'s chain of
    ``__wrapped__`` (outermost first), if any."""
    for _ in range(32):
        if obj is None:
            return None
        if type(obj) is HsfixWrapper and (patch_id is None or obj.hsfix_patch == patch_id):
            return obj
        swapped = getattr(obj, "__dict__", {}).get(SWAPPED) if callable(obj) else None
        if swapped is not None and patch_id in (None, swapped):
            return obj
        # A wrapt proxy answers ``__wrapped__`` itself (it is not forwarded).
        obj = getattr(obj, "__wrapped__", None)
    return None


def original_of(obj: object) -> object:
    """What our wrappers in ``obj``'s chain wrap (``obj`` when there is none)."""
    ours = ours_in(obj)
    return ours.__wrapped__ if ours is not None else obj


def raw_attribute(owner: object, name: str) -> object:
    """The attribute as stored (class dict for classes, so methods stay unbound)."""
    if isinstance(owner, type) and name in owner.__dict__:
        return owner.__dict__[name]
    return getattr(owner, name, None)


@dataclass(frozen=True)
class Replacement:
    """One attribute this package wrapped: where, what was there, and our wrapper."""

    owner: object
    name: str
    original: object
    wrapper: HsfixWrapper

    def in_effect(self) -> bool:
        """Our wrapper is reachable through the attribute and switched on."""
        ours = ours_in(raw_attribute(self.owner, self.name), self.wrapper.hsfix_patch)
        return ours is self.wrapper and self.wrapper.hsfix_active

    def restore(self) -> str:
        """Turn our wrapper off; put the original back if ours is still outermost.
        Returns "restored" or "pass-through"."""
        self.wrapper.hsfix_set_active(False)
        current = raw_attribute(self.owner, self.name)
        if current is self.wrapper:
            if self.original is ABSENT:
                delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, self.original)
            return "restored"
        log.warning(
            "%s.%s was wrapped again (by %s) after vllm-hsfix patched it: leaving that "
            "wrapper in place; vllm-hsfix's wrapper beneath it now passes straight through",
            getattr(self.owner, "__name__", self.owner),
            self.name,
            type(current).__name__,
        )
        return "pass-through"


def wrap(owner: object, name: str, wrapper: WrapperFn, patch_id: str) -> Replacement:
    """Wrap ``owner.name``; if this patch's wrapper is already in the chain (switched
    off by an earlier revert, or still on), switch it on instead of wrapping twice."""
    current = raw_attribute(owner, name)
    ours = ours_in(current, patch_id)
    if ours is not None:
        ours.hsfix_set_active(True)
        return Replacement(owner, name, ours.__wrapped__, ours)
    wrapped = HsfixWrapper(current, wrapper, patch_id)
    setattr(owner, name, wrapped)
    return Replacement(owner, name, current, wrapped)


SWAPPED = "__hsfix_swapped__"  # set on a function :func:`swap` installed: its patch id


@dataclass(frozen=True)
class FunctionSwap:
    """A method replaced by a plain function, for targets ``torch.compile(fullgraph=True)``
    traces. No switch: reverting puts the original back only if ours is still there."""

    owner: type
    name: str
    original: Any
    replacement: Any

    def in_effect(self) -> bool:
        return self.owner.__dict__.get(self.name) is self.replacement

    def restore(self) -> str:
        if self.in_effect():
            setattr(self.owner, self.name, self.original)
            return "restored"
        log.warning(
            "%s.%s was replaced again after vllm-hsfix patched it: leaving that in place",
            self.owner.__name__,
            self.name,
        )
        return "pass-through"


def swap(owner: type, name: str, build: Callable[[Any], Any], patch_id: str) -> FunctionSwap:
    """Set ``owner.name`` to ``build(original)``, marked as this patch's (and with
    ``__wrapped__`` = the original, so probes see the release's own code)."""
    current = owner.__dict__[name]
    if getattr(current, "__dict__", {}).get(SWAPPED) == patch_id:
        return FunctionSwap(owner, name, current.__wrapped__, current)
    replacement = build(current)
    setattr(replacement, SWAPPED, patch_id)
    replacement.__wrapped__ = current
    setattr(owner, name, replacement)
    return FunctionSwap(owner, name, current, replacement)


def call_through(fn: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The wrapper of an added attribute: our implementation is what it wraps."""
    return fn(*args, **kwargs)


def add(owner: type, name: str, implementation: Any, patch_id: str) -> Replacement:
    """Define ``owner.name`` (absent from the class itself) as our wrapper around
    ``implementation``; reverting deletes it, adding again switches it back on."""
    current = owner.__dict__.get(name, ABSENT)
    ours = ours_in(current, patch_id) if current is not ABSENT else None
    if ours is not None:
        ours.hsfix_set_active(True)
        return Replacement(owner, name, ABSENT, ours)
    if current is not ABSENT:
        raise ValueError(
            f"{getattr(owner, '__name__', owner)}.{name} exists already: not adding ours"
        )
    label = f"{getattr(owner, '__name__', owner)}.{name}"
    added = HsfixWrapper(implementation, call_through, patch_id, added=label)
    setattr(owner, name, added)
    return Replacement(owner, name, ABSENT, added)


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """A wrapped method's argument ``name`` (position ``index`` after ``self``)."""
    return kwargs[name] if name in kwargs else args[index]


def subclasses(cls: type) -> list[type]:
    """Every class below ``cls``, however deep (where a wrapper on ``cls`` may not reach)."""
    return [s for sub in cls.__subclasses__() for s in (sub, *subclasses(sub))]
