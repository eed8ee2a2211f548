"""The real CUDA ``vllm`` wheel's Python code unpacked over the CPU torch venv (marked
``gpu_image``): ``status``, a GPU worker patched by the plugin loader, and ``verify``."""

from __future__ import annotations

import json
import re

import pytest
from conftest import INSTALL, RELEASE, clean_env, last_json
from support import skeletons as sk
from support.commands import cli
from support.procs import child, child_json

# A skipif mark, not a module-level skip: the other rows deselect these by their marker.
pytestmark = [
    pytest.mark.needs_vllm,
    pytest.mark.gpu_image,
    pytest.mark.skipif(
        INSTALL.distribution != "vllm",
        reason=f"needs the CUDA vllm wheel (scripts/run_tests.py --only gpu-image); "
        f"have {INSTALL.distribution} {INSTALL.version}",
    ),
]

MARK = "HSFIX-TEST-MARK first print of the process"


def stated() -> dict[str, str]:
    """What a GPU image must get, stated by hand from the README's table, not from the code."""
    if RELEASE not in ("0.24.0", "0.25.0"):
        pytest.skip(f"no stated expectation for the CUDA wheel of {RELEASE}")
    return sk.stated(RELEASE)


def test_the_cuda_wheels_own_distribution_answers_for_vllm() -> None:
    """cpu-dist-name stays away on the CUDA wheel: ``vllm`` is the real distribution."""
    found = child_json("lookups.py", "distributions", timeout=60)
    assert found == [["vllm", INSTALL.version, False]], found


def test_status_text_on_the_cuda_wheel() -> None:
    """The line a GPU image's build check prints (the JSON report of the same files:
    test_shapes.py's status on every CUDA skeleton, test_cli.py's ``--require``)."""
    want = stated()
    text = cli("status")
    assert text.returncode == 0, text.stdout
    if "would-apply" in want.values():
        applied = ", ".join(p for p, c in want.items() if c == "would-apply")
        line = f"will patch every vLLM process when it starts: {applied}"
        assert line in text.stdout, text.stdout
    else:
        assert "fixed upstream, nothing to do" in text.stdout, text.stdout


def _summary_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(r"\bvllm-hsfix \S+ pid=\d+", ln)]


def test_a_gpu_worker_is_patched_by_vllms_plugin_loader_and_logs_its_line_at_start() -> None:
    """A process doing what a GPU worker does (vLLM's ``load_general_plugins()``, then model,
    connector and GPU runner) is activated by the entry point, logs its line first, saying the
    CPU block zeroing is not needed, and ends patched; the platform is not vLLM's CPU one."""
    want = stated()
    env = clean_env(PYTHONUNBUFFERED="1")  # one pipe, in the order things happened
    out = child("startup.py", "gpu_worker", MARK, env=env, merge=True)
    assert out.returncode == 0, out.stdout[-3000:]
    text = out.stdout
    assert MARK in text, text[-3000:]
    before, _, after = text.partition(MARK)
    lines = _summary_lines(before)
    assert lines, f"no vllm-hsfix line before the process's first print:\n{before[-3000:]}"
    assert not _summary_lines(after), "the line was logged more than once"
    line = lines[0]
    assert f"vllm={INSTALL.version} (vllm)" in line, line
    groups = {g.split(" ", 1)[0]: g for g in line.split(": ", 1)[1].split("; ")}
    applied = [p for p, c in want.items() if c == "would-apply"]
    if applied:
        # Targets not imported yet: listed as applied or on import, never refused or failed.
        group = groups.get("applied") or groups.get("on")
        assert group is not None, line
        assert all(p in group for p in applied), line
    skipped = groups.get("skipped", "")
    assert all(f"{p} [{c}]" in skipped for p, c in want.items() if c != "would-apply"), line
    got = last_json(after, objects_only=True)
    assert got["by"][0] == "plugin", got
    assert got["vllm"]["distribution"] == "vllm" and got["vllm"]["cpu_build"] is False, got
    for pid, code in want.items():  # before the imports: armed, or final
        assert got["early"][pid] == ("armed" if code == "would-apply" else code), got
    assert got["cpu_runner_imported"] is False, got
    assert got["codes"] == {k: ("applied" if v == "would-apply" else v) for k, v in want.items()}
    assert got["platform"] == "UnspecifiedPlatform", got


def test_verify_runs_through_the_cuda_wheels_live_code() -> None:
    want = stated()
    out = cli("verify", "--device", "cpu", "--json", timeout=600)
    report = json.loads(out.stdout)
    assert out.returncode == 0, json.dumps(report)[-3000:]
    assert report["ok"] is True and report["device"] == "cpu"
    assert report["vllm"]["distribution"] == "vllm", report["vllm"]
    names = [c["check"] for c in report["checks"]]
    assert "scatter bfloat16 contiguous" in names and "scatter float32 strided view" in names
    assert any(n.startswith("connector group / block size") for n in names), names
    statuses = {k: v["status"] for k, v in report["patches"].items()}
    for pid, code in want.items():
        assert statuses[pid] == ("applied" if code == "would-apply" else "skipped"), statuses
