"""Each row of the patch table names every attribute its ``apply`` replaces or adds on the
installed release."""

from __future__ import annotations

import pytest
from conftest import INSTALL, clean_env, declared
from support.procs import child_json

from vllm_hsfix.patches import PATCHES


@pytest.mark.needs_vllm
def test_a_row_wraps_exactly_the_names_it_lists() -> None:
    """Each row applied alone to its real module replaces or adds only names in its ``wraps``."""
    rows = [p for p in PATCHES if declared(p) == "applied"]
    if not rows:
        pytest.skip(f"no row applies on vLLM {INSTALL.release}")
    ids = [p.id for p in rows]
    got = child_json("lookups.py", "wraps", *ids, env=clean_env(VLLM_HSFIX_DISABLE="1"))
    assert set(got) == {p.id for p in rows}
    for row in rows:
        assert got[row.id], f"{row.id} replaced nothing on {INSTALL.release}"
        unnamed = set(got[row.id]) - set(row.wraps)
        assert not unnamed, f"{row.id} on {INSTALL.release} wraps {unnamed}, not in its row"
