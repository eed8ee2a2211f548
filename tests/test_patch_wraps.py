"""Each row of the patch table names what it wraps (``PatchSpec.wraps``), and that is
what its ``apply`` replaces or adds on the real module of the installed release comes
from that list: a reader of the table sees every method a patch touches."""

from __future__ import annotations

import pytest
from conftest import INSTALL, clean_env, declared
from support.procs import child_json

from vllm_hsfix.patches import PATCHES


@pytest.mark.needs_vllm
def test_a_row_wraps_exactly_the_names_it_lists() -> None:
    """Each row that applies on the installed release, applied by itself to the real
    module (vllm-hsfix otherwise off): every name it replaces or adds is in the row's
    ``wraps`` (a row lists the names of every shape it knows: ``cpu-connector-save``
    wraps ``save_kv_layer`` on 0.22-0.23 and ``_submit_async_write`` from 0.24.0)."""
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
