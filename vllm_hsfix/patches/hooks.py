"""What a patch or an extra may call back into at run time (neither imports the runtime)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hooks:
    """``on_failure(patch_id, exc)``: a wrapper met an unexpected error (it is recorded;
    the wrapper itself decides whether to raise). ``in_place(patch_id)``: that row is,
    or once its target is imported will be, in place in this process (a row whose fix
    rests on another's)."""

    on_failure: Callable[[str, BaseException], None]
    in_place: Callable[[str], bool] = lambda patch_id: False


@dataclass(frozen=True)
class ExtraContext:
    """What an extra's ``wanted(ctx)`` and ``install(module, ctx)`` get: the switches,
    the release, the rows applied in this process, and the runtime's callbacks."""

    config: Any
    release: str
    applied: tuple[Any, ...]
    after_register: Callable[[Any], None]  # a worker registered its KV caches
    on_error: Callable[[str, BaseException], None]
    metadata: Callable[[], dict[str, str]]  # provenance keys of a file written now
