"""The hazard register: known ways a pinned vLLM loses or corrupts hidden states on the
extraction path, and what vllm-hsfix does about each (``patch``, ``refuse-config`` or
``documented``); then the ``refuse-config`` extra, which checks a release's settings
when the scheduler's connector is built. Each row's evidence: ``docs/hazards.md``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .codes import IN_PLACE, Code
from .patches import PATCHES
from .patches import by_id as patch_row
from .patches._wrap import Replacement, wrap
from .releases import fixed, reached

if TYPE_CHECKING:
    from .patches.hooks import ExtraContext

PATCH, REFUSE_CONFIG, DOCUMENTED = "patch", "refuse-config", "documented"
PROCESS, DATA = "process", "data"  # what is lost
NOT_AFFECTED, FIXED_UPSTREAM, PATCHED = "not-affected", "fixed-upstream", "patched"
CHECKED, OPEN, EXPOSED, UNKNOWN = "checked-at-start", "open", "exposed", "unknown"


@dataclass(frozen=True)
class Hazard:
    """One known hazard. ``first`` and ``fixed_in`` bound the affected releases
    (``fixed_in`` None: no upstream fix); ``ends`` bounds them instead where the code
    concerned went away without a fix."""

    id: str
    first: str
    fixed_in: str | None
    loses: str  # PROCESS or DATA
    upstream: str
    action: str
    why_action: str = ""  # for DOCUMENTED: why nothing better is done
    patch: str = ""  # the patch row, for PATCH
    setting: str = ""  # the setting to change, for REFUSE_CONFIG
    workaround: str = ""  # for DOCUMENTED: what a user can do
    models: str = ""  # only these models are concerned ("" = any)
    ends: str | None = None
    cpu_only: bool = False  # vLLM's CPU build only (a patched hazard: its row's platform)
    amx_only: bool = False  # only on a CPU with AMX (a kernel path no other CPU takes)

    @property
    def until(self) -> str | None:
        return self.fixed_in or self.ends

    @property
    def releases(self) -> str:
        """PEP 440 specifiers of the releases affected."""
        return f">={self.first}" + (f",<{self.until}" if self.until else "")

    def affects(self, version: str) -> bool:
        """Whether release ``version`` has the hazard (bounded as the patch rows are:
        :func:`releases.reached` and :func:`releases.fixed`)."""
        if not reached(version, self.first):
            return False
        return self.until is None or not fixed(version, self.until)


def patched(hazard_id: str, patch_id: str, **fields: Any) -> Hazard:
    """A hazard a patch row covers: its releases are the row's, from its ``first`` to
    upstream's fix (open-ended where none is known)."""
    row = patch_row(patch_id)
    return Hazard(hazard_id, row.first, row.fixed_in, action=PATCH, patch=patch_id, **fields)


def _covered() -> tuple[Hazard, ...]:
    """The hazards the patch units declare (``HAZARD`` beside their row)."""
    units = (importlib.import_module(p.impl.rsplit(".", 1)[0]) for p in PATCHES)
    declared = (({**u.HAZARD}, u.ROW.id) for u in units if hasattr(u, "HAZARD"))
    return tuple(patched(h.pop("id"), row, **h) for h, row in declared)


HAZARDS: tuple[Hazard, ...] = (
    *_covered(),
    Hazard(
        id="drafter-skip",
        first="0.25.0",
        fixed_in="0.29.0",
        loses=DATA,
        upstream="vllm-project/vllm#53962 (a crash fix upstream; first released in 0.29.0)",
        action=REFUSE_CONFIG,
        setting=(
            "enable_prefix_caching=False (--no-enable-prefix-caching), or a max_model_len "
            "(--max-model-len) with max_model_len - 2 not a multiple of the scheduler's KV "
            "block size (e.g. one less)"
        ),
    ),
    Hazard(
        id="torn-files-in-step",
        first="0.17.0",
        fixed_in=None,
        ends="0.22.0",
        loses=DATA,
        upstream="none; 0.22.0 moved the save to a writer thread with a .lock (still in place)",
        action=DOCUMENTED,
        why_action=(
            "a different writer (inside save_kv_layer, per step) than the one atomic-writes "
            "wraps; not patched"
        ),
        workaround="safetensors >= 0.8.0, which renames into place itself",
    ),
    Hazard(
        id="cpu-amx-gdn-stale-tiles",
        first="0.22.0",
        fixed_in="0.27.0",
        models="vLLM's CPU build on AMX; GDN models with 64-dim linear heads (released: 128)",
        cpu_only=True,
        amx_only=True,
        loses=PROCESS,
        upstream="0.27.0's rewritten GDN prefill kernels call brgemm_release() (no PR named)",
        action=DOCUMENTED,
        why_action="a SIGILL inside vLLM's C++ kernel, from no released model's config",
        workaround="vLLM >= 0.27.0, 128-dim linear heads, or a CPU without AMX",
    ),
)


HAZARD_IDS: tuple[str, ...] = tuple(h.id for h in HAZARDS)


def by_id(hazard_id: str) -> Hazard:
    for h in HAZARDS:
        if h.id == hazard_id:
            return h
    raise KeyError(f"unknown hazard id {hazard_id!r}; known: {list(HAZARD_IDS)}")


def _state(
    hazard: Hazard, version: str, patch_codes: dict[str, str], active: bool
) -> tuple[str, str]:
    """(state, reason) of an affected or unaffected release (see :func:`assess`)."""
    if not hazard.affects(version):
        if hazard.fixed_in is not None and fixed(version, hazard.fixed_in):
            return FIXED_UPSTREAM, f"fixed in {hazard.fixed_in}"
        return NOT_AFFECTED, f"vLLM {version} is not {hazard.releases}"
    if hazard.action == PATCH:
        code = patch_codes.get(hazard.patch, "missing")
        if code == Code.NOT_NEEDED:  # its patch's target is not affected here
            return NOT_AFFECTED, f"patch {hazard.patch}: {code}"
        if code == Code.UPSTREAM_FIX:  # the release's code has the fix (its shape says)
            return FIXED_UPSTREAM, f"patch {hazard.patch}: {code}"
        if code in IN_PLACE:
            return PATCHED, f"patch {hazard.patch}: {code}"
        return OPEN, f"patch {hazard.patch} is {code}"
    if hazard.action == REFUSE_CONFIG:
        if not active:  # VLLM_HSFIX_DISABLE=1 turns the check off with everything else
            return EXPOSED, f"vllm-hsfix is off; {hazard.setting}"
        return (
            CHECKED,
            f"a WARNING at engine start (strict: start-up fails) unless {hazard.setting}",
        )
    return EXPOSED, hazard.workaround or hazard.why_action


def assess(
    hazard: Hazard,
    version: str | None,
    patch_codes: dict[str, str],
    active: bool = True,
    cpu_build: bool | None = None,
    amx: bool | None = None,
) -> dict[str, str]:
    """One hazard's state on ``version`` (None: unknown), given each patch's ``status``
    code; ``open`` (its patch not in place) is the only state of vllm-hsfix's making.
    ``cpu_build``, ``amx`` (None: unknown): whether this is vLLM's CPU build, on AMX."""
    fields = ("action", "releases", "loses", "upstream", "models")  # models: where it has one
    out = {k: getattr(hazard, k) for k in fields if getattr(hazard, k)}
    if hazard.cpu_only and cpu_build is False:
        return {**out, "state": NOT_AFFECTED, "reason": "not vLLM's CPU build"}
    if hazard.amx_only and amx is False:
        return {**out, "state": NOT_AFFECTED, "reason": "this CPU has no AMX"}
    if version is None:
        return {**out, "state": UNKNOWN, "reason": "the installed vLLM release is unknown"}
    try:
        state, reason = _state(hazard, version, patch_codes, active)
    except ValueError:
        state, reason = UNKNOWN, f"unreadable version {version!r}"
    return {**out, "state": state, "reason": reason}


def assess_all(
    version: str | None,
    patch_codes: dict[str, str],
    active: bool = True,
    cpu_build: bool | None = None,
    amx: bool | None = None,
) -> dict[str, dict[str, str]]:
    return {h.id: assess(h, version, patch_codes, active, cpu_build, amx) for h in HAZARDS}


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this machine's CPU has AMX tiles (the kernel's ``amx_tile`` flag), from
    ``cpuinfo`` without importing torch; None where that cannot be read (not Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    flags = [ln for ln in text.splitlines() if ln.startswith("flags")]
    return any("amx_tile" in ln.split() for ln in flags) if flags else None


def refuse_config(version: str | None) -> tuple[Hazard, ...]:
    """The ``refuse-config`` rows of release ``version`` (none on an unreadable one)."""
    try:
        return tuple(h for h in HAZARDS if h.action == REFUSE_CONFIG and h.affects(version or ""))
    except ValueError:
        return ()


# The refuse-config extra (patches.EXTRAS): one check per refuse-config row.
EXTRA_ID = "refuse-config"  # the extra's id and its wrapper's mark
ATTRIBUTE = "ExampleHiddenStatesConnector"
SCHEDULER = "SCHEDULER"  # KVConnectorRole.SCHEDULER.name
NO_PREFIX_CACHING = "--no-enable-prefix-caching (enable_prefix_caching=False)"

Check = Callable[[Any, Any], "str | None"]


def scheduler_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """The block size prefix-cache hits are aligned to: the release's
    ``resolve_kv_cache_block_sizes``, else its rule by hand (the LCM of the groups')."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        if kv_cache_config is not None:
            return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[0])
    except (ImportError, AttributeError, ValueError):
        pass
    if len(groups) > 1:
        return math.lcm(*(int(g.kv_cache_spec.block_size) for g in groups))
    return int(vllm_config.cache_config.block_size)


def drafter_skip_lengths(max_model_len: int, block_size: int, num_spec: int) -> list[int]:
    """Cached lengths ``m`` (multiples of ``block_size``) padded to max_model_len so the
    drafter is skipped: ``max_model_len - 2n <= m <= max_model_len - 1 - n`` (PR 53962)."""
    low, high = max(1, max_model_len - 2 * num_spec), max_model_len - 1 - num_spec
    first = -(-low // block_size) * block_size
    return list(range(first, high + 1, block_size))


def safe_max_model_len(max_model_len: int, block_size: int, num_spec: int) -> int | None:
    """The largest ``max_model_len`` below the given one without the trigger (None
    when every nearby one has it, e.g. block size 1)."""
    for candidate in range(max_model_len - 1, max(max_model_len - 2 * block_size - 1, 1), -1):
        if not drafter_skip_lengths(candidate, block_size, num_spec):
            return candidate
    return None


def drafter_skip(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """drafter-skip: prefix caching on and a cached length padded to max_model_len."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return None
    spec = vllm_config.speculative_config
    num_spec = int(getattr(spec, "num_speculative_tokens", None) or 1)
    max_len = int(vllm_config.model_config.max_model_len)
    size = scheduler_block_size(vllm_config, kv_cache_config)
    lengths = drafter_skip_lengths(max_len, size, num_spec)
    if not lengths:
        return None
    m = lengths[-1]
    safe = safe_max_model_len(max_len, size, num_spec)
    change = NO_PREFIX_CACHING
    if safe is not None:
        change += f", or --max-model-len {safe} (max_model_len={safe})"
    return (
        f"prefix caching is on and max_model_len={max_len} with KV block size {size}: a "
        f"prompt of {m + 1} tokens with {m} of them in the prefix cache, arriving while "
        "another request decodes, is padded to max_model_len, and the hidden-states "
        "writer is skipped for that whole step (stale rows in the file of every request "
        f"in it; fixed in vLLM 0.29.0, PR 53962). Change: {change}"
    )


# One check per refuse-config row of the register (tests/test_refuse_config.py).
CHECKS: dict[str, Check] = {
    "drafter-skip": drafter_skip,
}


def message(hazard: Hazard, version: str, found: str) -> str:
    """The WARNING (and, in strict mode, the error): hazard, release, what was found."""
    span = f"{hazard.first} up to {hazard.until}" if hazard.until else f"{hazard.first} on"
    return f"hazard {hazard.id} on vLLM {version} (affects {span}): {found}"


def _role_name(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    role = getattr(instance, "role", None)
    if role is None:
        role = kwargs.get("role", args[1] if len(args) > 1 else None)
    return str(getattr(role, "name", role))


def _installed(
    rows: tuple[Hazard, ...],
    version: str,
    on_trigger: Callable[[Hazard, str], None],
    on_error: Callable[[str, BaseException], None],
) -> Any:
    def __init__(
        wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        wrapped(*args, **kwargs)
        if _role_name(instance, args, kwargs) != SCHEDULER:
            return
        for hazard in rows:
            try:
                found = CHECKS[hazard.id](
                    instance._vllm_config, getattr(instance, "_kv_cache_config", None)
                )
            except Exception as exc:  # a check never stops an engine by accident
                on_error(f"{EXTRA_ID} check failed: {exc!r}", exc)
                continue
            if found is not None:
                on_trigger(hazard, message(hazard, version, found))  # raises in strict mode

    return __init__


def wanted(ctx: ExtraContext) -> bool:
    """Where the release has a ``refuse-config`` row."""
    return bool(refuse_config(ctx.release)) if ctx.release else False


def install(module: object, ctx: ExtraContext) -> Replacement | None:
    """The ``refuse-config`` extra: wrap the connector's ``__init__`` to check the rows
    of ``ctx.release`` (None: nothing to check, or no connector class)."""
    rows, cls = refuse_config(ctx.release), getattr(module, ATTRIBUTE, None)
    if not rows or not isinstance(cls, type):
        return None
    checks = _installed(rows, ctx.release, ctx.on_hazard, ctx.on_error)
    return wrap(cls, "__init__", checks, EXTRA_ID)
