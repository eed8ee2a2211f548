"""What a patch may call back into at run time, handed to it by the runtime.

Patches sit below the runtime and never import it: a wrapper that must report a
failure, or run the in-situ check once a worker has registered its caches, calls
these instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hooks:
    """``on_failure(patch_id, exc)``: a wrapper met an unexpected error (it is recorded;
    the wrapper itself decides whether to raise). ``after_register(connector)``: the
    connector registered its KV caches (the in-situ check runs here)."""

    on_failure: Callable[[str, BaseException], None]
    after_register: Callable[[Any], None]


@dataclass(frozen=True)
class ExtraContext:
    """What an extra's ``install(module, ctx)`` may use (``patches.EXTRAS``): the
    patches' callbacks (the in-situ observer calls ``hooks.after_register``), the
    release, the provenance keys of a file written now, and the config check's
    callbacks (a triggered hazard; an error of the check itself)."""

    hooks: Hooks
    release: str
    provenance_metadata: Callable[[], dict[str, str]]
    on_config_hazard: Callable[[Any, str], None]
    on_config_error: Callable[[BaseException], None]
