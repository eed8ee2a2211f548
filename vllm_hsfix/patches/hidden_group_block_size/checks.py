"""``hidden-group-block-size``'s ``verify``: the live connector class, built on a
hybrid layout, reads with the hidden-states group's block size."""

from __future__ import annotations

from typing import Any

from ... import checks
from ...checks import construct_connector, hidden_group, hybrid_layout, result
from ...releases import reached
from . import ROW


def connector_checks(cls: Any, version: str | None, first: str) -> list[dict[str, Any]]:
    """The live connector class ``cls`` resolves a hybrid layout to the hidden group's
    own block size (skipped before release ``first``, the hidden-group-block-size
    row's: releases before it never read with it)."""
    name = "connector group / block size (hybrid: 528, 528, hidden 22)"
    if version is None or not reached(version, first):
        why = f"vLLM {version}: the connector does not read with its block size before {first}"
        return [result(name, [], skipped=why)]
    config, want = hybrid_layout()
    problems: list[str] = []
    try:
        conn = construct_connector(cls, config, want["global_block_size"])
    except Exception as exc:
        return [result(name, [f"construction failed: {exc!r}"])]
    got = {"group": hidden_group(conn), "block_size": conn._block_size}
    expected = {"group": want["group"], "block_size": want["block_size"]}
    if got != expected:
        problems.append(f"resolved {got}, expected {expected}")
    return [result(name, problems, resolved=got)]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live class, built on a hybrid layout, reads with block size 22, not 528."""
    return connector_checks(module.ExampleHiddenStatesConnector, ctx.version, ROW.first)
