"""The GPU check without a GPU: it refuses with a reason, its CPU dry run passes, planted
wrong replacements fail exactly the replacement tests, the release tests see the bug, and
the scatter benchmark exits 1 on wrong bytes."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE, RELEASE, ROOT, clean_env
from support import scatter_check

from vllm_hsfix.patches.scatter_clamp import fix as scatter

pytestmark = pytest.mark.skipif(
    RELEASE != "0.24.0",
    reason=f"the GPU check does not depend on the installed vLLM: 0.24.0 rows only ({RELEASE})",
)

RELEASES = ("0.17.0", "0.22.0", "0.24.0")
TARGET = Path("vllm/model_executor/models/extract_hidden_states.py")
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


GRC = scatter_check.RELEASE_CODE


def overlay_file(release: str) -> Path:
    path = CACHE / "overlays" / f"vllm-{release}" / TARGET
    if not path.is_file():
        pytest.skip(f"no overlay of {release}: python3 scripts/vllm_env.py ensure {release}")
    return path


@pytest.fixture(scope="module")
def release_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three releases' files, copied by the script the GPU check is prepared with."""
    for release in RELEASES:
        overlay_file(release)
    dest = tmp_path_factory.mktemp("gpu-release-code")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_release_code.py"), "--dest", str(dest)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for release in RELEASES:
        copied = dest / f"vllm-{release}" / TARGET.name
        assert copied.read_bytes() == overlay_file(release).read_bytes()
    return dest


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env=clean_env(**{"OUT": str(out), "PYTHON": sys.executable, **env}),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def junit(path: Path) -> dict[str, str]:
    """Test name -> passed / failed / skipped: <reason>, from a pytest junit report."""
    states = {}
    for case in ET.parse(path).iter("testcase"):
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            states[case.get("name", "")] = "failed"
        elif skipped is not None:
            states[case.get("name", "")] = "skipped: " + skipped.get("message", "")
        else:
            states[case.get("name", "")] = "passed"
    return states


# Written out, not derived from tests/gpu/test_gpu.py: the tests that check what the
# replacement stores, on the CPU.
RELEASES_LAYOUTS = ["0.17.0-contiguous", "0.22.0-contiguous", "0.22.0-strided"]
RELEASES_LAYOUTS += ["0.24.0-contiguous", "0.24.0-strided"]
REPLACEMENTS = ["scatter_flat-contiguous", "scatter_clamped-contiguous", "scatter_clamped-strided"]
REPLACEMENT_BYTE_TESTS = {
    *(
        f"test_replacement_bytes[{fn}-torch.{dtype}]"
        for fn in REPLACEMENTS
        for dtype in ("bfloat16", "float16", "float32")
    ),
    *(f"test_release_replacement_keeps_the_live_last_slot[{v}]" for v in RELEASES_LAYOUTS),
    "test_flat_view_release_and_replacement_refuse_a_strided_view[0.17.0]",
}
RELEASE_ORIGINAL_TESTS = {
    f"test_release_original_overwrites_the_live_last_slot[{v}]" for v in RELEASES_LAYOUTS
}


@NO_CUDA
def test_gpu_check_exits_2_without_a_cuda_device(tmp_path: Path) -> None:
    out = gpu_check(tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot run here: no CUDA GPU" in out.stderr
    assert "torch.cuda.is_available() is False" in out.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "no CUDA GPU" in summary and "exit 2" in summary
    assert not (tmp_path / "tests.txt").exists()  # nothing ran


def test_gpu_check_exits_2_without_torch(tmp_path: Path) -> None:
    out = gpu_check(tmp_path, PYTHON=str(tmp_path / "no-such-python"))
    assert out.returncode == 2
    assert "cannot run here" in out.stderr


def test_cpu_dry_run_passes_with_the_real_replacements(release_code: Path, tmp_path: Path) -> None:
    out = gpu_check(
        tmp_path, VLLM_HSFIX_CHECK_DEVICE="cpu", VLLM_HSFIX_RELEASE_CODE=str(release_code)
    )
    summary = (tmp_path / "summary.txt").read_text()
    assert out.returncode == 0, summary
    assert "CPU DRY RUN" in summary and "gpu_check: exit 0" in summary
    for step in ("release-code", "tests", "planted-unclamped", "planted-wrong-slot", "bench"):
        assert any(line.split()[:2] == [step, "ok"] for line in summary.splitlines()), step
    states = junit(tmp_path / "tests-junit.xml")
    for name in REPLACEMENT_BYTE_TESTS | RELEASE_ORIGINAL_TESTS:
        assert states.get(name) == "passed", (name, states.get(name))
    skipped = {n: s for n, s in states.items() if s.startswith("skipped")}
    assert skipped, "the CUDA-only tests must be listed as skipped on the CPU"
    assert all("need a CUDA device" in s for s in skipped.values()), skipped
    assert "failed" not in states.values()
    for plant in ("unclamped", "wrong-slot"):  # a wrong replacement fails exactly these
        planted = junit(tmp_path / f"planted-{plant}-junit.xml")
        failed = {n for n, s in planted.items() if s == "failed"}
        assert failed == REPLACEMENT_BYTE_TESTS, (plant, sorted(failed ^ REPLACEMENT_BYTE_TESTS))


def test_gpu_check_fails_without_the_release_code(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = gpu_check(
        tmp_path / "out",
        VLLM_HSFIX_CHECK_DEVICE="cpu",
        VLLM_HSFIX_RELEASE_CODE=str(empty),
        VLLM_HSFIX_CHECK_STEPS="release-code tests",
    )
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert out.returncode == 1, summary
    lines = [line.split()[:2] for line in summary.splitlines()]
    assert ["release-code", "FAIL1"] in lines and ["tests", "FAIL1"] in lines, summary
    assert "gpu_check: exit 1" in summary and "ONLY THESE STEPS: release-code tests" in summary
    assert "MISSING 0.17.0" in (tmp_path / "out" / "release-code.txt").read_text()
    # In the GPU check a missing release file fails its tests; it never skips them.
    states = junit(tmp_path / "out" / "tests-junit.xml")
    for name in RELEASE_ORIGINAL_TESTS:
        assert states[name] == "failed", (name, states[name])


def test_the_gpu_tests_tell_a_fixed_release_from_an_affected_one() -> None:
    """0.25.0's own basic_cache fails "original overwrites" and passes "replacement keeps"."""
    fixed = GRC.compile_basic_cache(overlay_file("0.25.0"))
    run = scatter_check.padded_run("cpu", torch.bfloat16, strided=True)
    got = scatter_check.run_eager(fixed, run)
    scatter_check.assert_replacement_keeps_live_slot(run, got)
    with pytest.raises(AssertionError):
        scatter_check.assert_original_overwrites_live_slot(run, got)
    affected = GRC.compile_basic_cache(overlay_file("0.24.0"))
    run = scatter_check.padded_run("cpu", torch.bfloat16, strided=True)
    got = scatter_check.run_eager(affected, run)
    scatter_check.assert_original_overwrites_live_slot(run, got)
    with pytest.raises(AssertionError, match="overwritten"):
        scatter_check.assert_replacement_keeps_live_slot(run, got)


def test_release_code_script_names_a_missing_overlay(tmp_path: Path) -> None:
    rc = GRC.main(["--overlays", str(tmp_path / "none"), "--dest", str(tmp_path / "d"), "0.17.0"])
    assert rc == 1
    assert not (tmp_path / "d" / "vllm-0.17.0").exists()


def test_bench_passes_then_exits_1_on_wrong_bytes(
    release_code: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    bench = scatter_check.load_script(ROOT / "benchmarks" / "bench_scatter.py")
    args = ["--device", "cpu", "--quick", "--reps", "1", "--no-vllm"]
    assert bench.main([*args, "--release-code", str(release_code)]) == 0
    printed = capsys.readouterr().out
    assert "scatter_clamped    strided / upstream: median" in printed
    assert "orig-0.17.0 contiguous / upstream: median" in printed

    # A release whose function is already fixed cannot show the bug: bad inputs.
    fixed = tmp_path / "fixed" / "vllm-0.25.0"
    fixed.mkdir(parents=True)
    (fixed / TARGET.name).write_bytes(overlay_file("0.25.0").read_bytes())
    assert bench.main([*args, "--release-code", str(tmp_path / "fixed")]) == 1
    assert "the bug does not show" in capsys.readouterr().out

    def unclamped(to_cache: Any, kv_cache: Any, slots: Any) -> None:
        bs = kv_cache.shape[1]
        kv_cache[slots // bs, slots % bs] = to_cache

    monkeypatch.setattr(scatter, "scatter_clamped", unclamped)
    assert bench.main(args) == 1
    assert "scatter_clamped: bytes differ from upstream's" in capsys.readouterr().out


def test_nothing_of_vllm_is_tracked() -> None:
    """The copied release files stay out of git (the folder is ignored)."""
    out = subprocess.run(
        ["git", "check-ignore", "-q", "gpu-release-code/vllm-0.24.0/extract_hidden_states.py"],
        cwd=ROOT,
        capture_output=True,
        timeout=30,
    )
    if out.returncode == 128 or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert out.returncode == 0, "gpu-release-code/ must be in .gitignore"
