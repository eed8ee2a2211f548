"""THE patch table: what is patched on which vLLM release and platform, and why.

``PATCHES`` has one row per patch, each declared in its unit (``patches/<unit>/``:
row and stated decision in ``__init__``, fix and gate in ``fix``); ``EXTRAS`` the
wrappers that fix nothing. The README's tables, ``status``, ``verify``, the runtime
and the tests all read these rows.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from .spec import ANY, CONNECTOR, CPU, PatchModule, PatchSpec

__all__ = ["ANY", "CONNECTOR", "CPU", "EXTRAS", "PATCHES", "PatchModule", "PatchSpec", "by_id"]

# One line per patch: its unit, in the order status and the README list them.
UNITS = (
    "scatter_clamp",
    "hidden_group_block_size",
    "aux_final_layer",
    "cpu_zero_blocks",
    "abort_before_scheduling",
    "cpu_connector_save",
    "slots_from_blocks",  # after cpu_connector_save: its save wrapper goes outside
    "allow_chunked_prefill",  # lifts 0.22-0.23's refusal where slots_from_blocks is in place
    "atomic_writes_in_step",  # 0.17-0.21's in-step writer; the rank check goes outside
    "tp_rank_zero_writes",  # outside both save wrappers: a rank other than 0 saves nothing
    "drafter_skip_guard",
    "next_token_last_valid",
    "cpu_sampler_fp64_flag",
    "cpu_gdn_wide_conv_state",
    "atomic_writes",
    "cpu_dist_name",
    # 0.17-0.19: an engine that fails to start, or dies from one request (issue 57)
    "nested_text_config",
    "hidden_cache_dtype",
    "draft_column",
    "no_new_blocks",
)
PATCHES: tuple[PatchSpec, ...] = tuple(
    importlib.import_module(f"{__name__}.{unit}").ROW for unit in UNITS
)


class Extra(NamedTuple):
    """A wrapper that fixes nothing (it observes, stamps or checks) on the connector
    module: ``impl`` provides ``wanted(ctx)`` (its condition) and ``install(module,
    ctx)`` (``patches.hooks.ExtraContext``); the runtime installs every extra the same way."""

    id: str
    wraps: str
    when: str  # ``wanted``, in words (the README's table)
    why: str
    impl: str
    # A failure to install is the package's error (strict mode raises), else a WARNING.
    required: bool = False


EXTRAS: tuple[Extra, ...] = (
    Extra(
        "observer",
        "ExampleHiddenStatesConnector.register_kv_caches",
        when="a patch is applied in the process, or VLLM_HSFIX_PROVENANCE=1",
        why=(
            "once per worker, when it registers its KV caches: note the aux layers and "
            "engine settings provenance stamps, and run the in-situ check of each applied "
            "patch that has one (unless VLLM_HSFIX_VERIFY=0)"
        ),
        impl="vllm_hsfix.observer",
    ),
    Extra(
        "provenance",
        "save_file",
        when="VLLM_HSFIX_PROVENANCE=1 (every release)",
        why=(
            "stamp each saved file with the patches, releases and engine settings it was "
            "written under, so audit and repair know what wrote it"
        ),
        impl="vllm_hsfix.provenance",
    ),
)


PATCH_IDS: tuple[str, ...] = tuple(p.id for p in PATCHES)
MODULES: tuple[str, ...] = tuple(dict.fromkeys([*(p.module for p in PATCHES), CONNECTOR]))


def by_id(patch_id: str) -> PatchSpec:
    for p in PATCHES:
        if p.id == patch_id:
            return p
    raise KeyError(f"unknown patch id {patch_id!r}; known: {list(PATCH_IDS)}")
