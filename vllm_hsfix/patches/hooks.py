"""What a patch may call back into at run time (patches never import the runtime)."""

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
