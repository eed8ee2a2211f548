"""Which patches reach the connector classes speculators' backends (hs-connectors) run:
``file`` is vLLM's connector, ``fp8`` a subclass with its own writer, ``mooncake`` its
own class with PR 46301's fix. From metadata and the patch table; nothing is imported.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from .codes import Code
from .patches import PATCHES, PatchSpec

DISTRIBUTION = "hs-connectors"
MODEL_MODULE = "vllm.model_executor.models.extract_hidden_states"
CONNECTOR = "ExampleHiddenStatesConnector"

# backend -> (connector class, its relation to vLLM's, methods it overrides, note)
BACKENDS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "file": (f"vllm ... {CONNECTOR}", "vLLM's own class", (), ""),
    "fp8": (
        "hs_connectors.fp8_hidden_states_connector.FP8HiddenStatesConnector",
        "subclass",
        ("_write_tensors",),
        "its own _write_tensors is wrapped by atomic-writes when the class is defined "
        "(vllm-hsfix verify checks it)",
    ),
    "mooncake": (
        "hs_connectors.mooncake_hidden_states_connector.MooncakeHiddenStatesConnector",
        "own class",
        (),
        "finds the hidden-states group by HiddenStateCacheSpec and uses its block size "
        "itself (PR 46301's fix in its own code); request_finished pops with a default (no "
        "KeyError on an abort before scheduling); writes to a Mooncake store, no files",
    ),
}


def installed() -> str | None:
    """hs-connectors' version, or None when it is not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def _reaches(patch: PatchSpec, relation: str, overrides: tuple[str, ...]) -> str:
    if patch.module == MODEL_MODULE:
        return "yes"  # the model's scatter runs whatever connector saves
    if not patch.attribute.startswith(CONNECTOR):
        return "yes"  # engine-wide (worker, sampler, CLI): every backend runs through it
    if relation == "own class":
        return "no (not vLLM's class)"
    method = patch.attribute.partition(".")[2]
    if method and method in overrides:
        return "yes (subclass's own method wrapped)" if patch.id == "atomic-writes" else "no"
    return "yes" if relation == "vLLM's own class" else "yes (inherited)"


def describe(codes: dict[str, str]) -> dict[str, Any] | None:
    """Per backend, whether each patch that would apply here reaches its connector;
    None when hs-connectors is not installed."""
    version = installed()
    if version is None:
        return None
    out: dict[str, Any] = {"version": version, "backends": {}}
    applying = [p for p in PATCHES if codes.get(p.id) == Code.APPLY]
    for name, (cls, relation, overrides, note) in BACKENDS.items():
        out["backends"][name] = {
            "connector": cls,
            "relation": relation,
            "patches": {p.id: _reaches(p, relation, overrides) for p in applying},
            "note": note,
        }
    return out
