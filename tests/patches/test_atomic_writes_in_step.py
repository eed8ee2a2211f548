"""``atomic-writes-in-step`` on the release's own in-step writer (0.17-0.21), killed
mid-write by the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONNECTOR_MODULE


@pytest.mark.needs_vllm
@pytest.mark.applies("atomic-writes-in-step")
def test_a_step_killed_mid_write_leaves_no_truncated_file(tmp_path: Path) -> None:
    """0.17-0.21: the release's in-step ``save_kv_layer`` killed by the kernel mid-write
    (1 MB limit, 8 MB of hidden states, an older file at the path), with safetensors <
    0.8.0's in-place write. Failing first: the release leaves a truncated file at the
    path. Patched: the older file is intact, only a temporary file is left."""
    import signal

    from conftest import clean_env, last_json
    from support.procs import child

    env = clean_env(VLLM_HSFIX_DISABLE="1")
    proc = child("killed_step_writer.py", tmp_path, CONNECTOR_MODULE, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = last_json(proc.stdout)
    print(out)
    assert [out[c]["killed_by"] for c in ("release", "patched")] == [signal.SIGXFSZ] * 2, out
    torn = out["release"]
    assert torn["size"] == 1 << 20 and torn["content"].startswith("unloadable"), torn
    assert out["patched"]["content"] == "old", out["patched"]
    assert any(n.endswith(".hsfix-tmp") for n in out["patched"]["leftovers"]), out
