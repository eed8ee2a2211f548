"""Environment switches (they reach vLLM's child processes), parsed once per process;
a bad value becomes a warning in ``status()`` and the safe reading is used.
"""

from __future__ import annotations

import os
from typing import NamedTuple

PREFIX = "VLLM_HSFIX_"
DISABLE = PREFIX + "DISABLE"  # "1": the package does nothing in this process
DISABLED_PATCHES = PREFIX + "DISABLED_PATCHES"  # comma list of patch ids to leave out
STRICT = PREFIX + "STRICT"  # "1": raise when the fix cannot apply (CI images)
VLLM_VERSION = PREFIX + "VLLM_VERSION"  # treat the installed vLLM as this release
VERIFY = PREFIX + "VERIFY"  # "0": no in-situ check when a worker registers its caches
STATUS_DIR = PREFIX + "STATUS_DIR"  # write each process's status as <dir>/<pid>.json
LOG_LEVEL = PREFIX + "LOG_LEVEL"  # logging level of the "vllm_hsfix" logger
PROVENANCE = PREFIX + "PROVENANCE"  # "1": saved hidden-states files carry our metadata
ATOMIC_WRITES = PREFIX + "ATOMIC_WRITES"  # "0": the atomic-writes patch is left out

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class Config(NamedTuple):
    disabled: bool = False
    disabled_patches: frozenset[str] = frozenset()
    strict: bool = False
    vllm_version_override: str | None = None
    verify: bool = True
    status_dir: str | None = None
    log_level: str = "INFO"
    provenance: bool = False
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """As reports print it (``status``, ``status()``)."""
        out = self._asdict()
        return {
            **out,
            "disabled_patches": sorted(self.disabled_patches),
            "warnings": list(self.warnings),
        }


def _flag(env: dict[str, str], name: str, default: bool, warnings: list[str]) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    warnings.append(f"{name}={raw!r} is not a boolean (use 1 or 0); using {int(default)}")
    return default


def load(env: dict[str, str] | None = None, known_patches: tuple[str, ...] = ()) -> Config:
    """Read the switches from ``env`` (default: ``os.environ``)."""
    env = dict(os.environ if env is None else env)
    warnings: list[str] = []
    disabled = _flag(env, DISABLE, False, warnings)
    strict = _flag(env, STRICT, False, warnings)
    verify = _flag(env, VERIFY, True, warnings)
    provenance = _flag(env, PROVENANCE, False, warnings)
    names = {p.strip() for p in env.get(DISABLED_PATCHES, "").split(",") if p.strip()}
    if not _flag(env, ATOMIC_WRITES, True, warnings):
        names.add("atomic-writes")  # the same as naming it in DISABLED_PATCHES
    if known_patches:
        unknown = sorted(names - set(known_patches))
        if unknown:
            warnings.append(
                f"{DISABLED_PATCHES} names unknown patch id(s) {unknown}; "
                f"known: {list(known_patches)}"
            )
    if disabled and strict:
        warnings.append(
            f"{DISABLE}=1 and {STRICT}=1 conflict: the package is disabled, so strict mode "
            "has nothing to enforce; nothing is patched and nothing is raised"
        )
        strict = False
    override = env.get(VLLM_VERSION, "").strip() or None
    level = env.get(LOG_LEVEL, "INFO").strip().upper() or "INFO"
    if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        warnings.append(f"{LOG_LEVEL}={level!r} is not a logging level; using INFO")
        level = "INFO"
    return Config(
        disabled=disabled,
        disabled_patches=frozenset(names),
        strict=strict,
        vllm_version_override=override,
        verify=verify,
        status_dir=env.get(STATUS_DIR) or None,
        log_level=level,
        provenance=provenance,
        warnings=tuple(warnings),
    )
