"""``vllm-hsfix status|verify|run``: output and exit codes a Dockerfile can rely on."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import INSTALL, clean_env, declared_code
from support.commands import cli

from vllm_hsfix.patches import PATCHES

pytestmark = pytest.mark.needs_vllm


def test_status_json_reads_the_environment_without_importing_vllm() -> None:
    out = cli("status", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout
    assert report["vllm"]["version"] == INSTALL.version
    assert report["activation"]["entry_point"]["registered"] is True
    assert report["activation"]["entry_point"]["value"] == "_vllm_hsfix_plugin:register"
    assert report["activation"]["bootstrap_usable"] is True
    codes = {k: v["code"] for k, v in report["patches"].items()}
    assert codes == {p.id: declared_code(p) for p in PATCHES}
    assert report["ok"] is True and report["problems"] == []


def test_status_text() -> None:
    out = cli("status")
    assert out.returncode == 0
    assert "result: OK" in out.stdout and "plugin entry point: registered" in out.stdout


@pytest.mark.applies("scatter-clamp")
@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"VLLM_HSFIX_DISABLE": "1"}, "disabled"),
        ({"VLLM_PLUGINS": "some_other_plugin"}, "leaves out vllm_hsfix"),
        ({"VLLM_HSFIX_VLLM_VERSION": "garbage"}, "unknown-version"),
    ],
)
def test_status_exit_code_is_nonzero_when_the_fix_cannot_apply(
    env: dict[str, str], needle: str
) -> None:
    out = cli("status", "--json", env=clean_env(**env))
    report = json.loads(out.stdout)
    assert out.returncode == 1
    assert report["ok"] is False
    assert any(needle in p for p in report["problems"]), report["problems"]


def test_status_without_vllm_exits_2() -> None:
    # A check run in the wrong virtualenv (no vLLM there) must not pass.
    out = cli("status", "--json", env=clean_env(PYTHONPATH=None))
    report = json.loads(out.stdout)
    assert out.returncode == 2 and report["vllm"]["present"] is False
    assert {v["code"] for v in report["patches"].values()} == {"no-vllm"}
    text = cli("status", env=clean_env(PYTHONPATH=None))
    assert text.returncode == 2 and "result: NO VLLM" in text.stdout


def test_status_disabled_fails_only_for_a_needed_fix() -> None:
    """``VLLM_HSFIX_DISABLE=1``: a row this release carries the fix for reads
    upstream-fix-present, one it does not concern not-needed (neither fails); a needed,
    non-optional row reads disabled and fails ``status``."""
    out = cli("status", "--json", env=clean_env(VLLM_HSFIX_DISABLE="1"))
    report = json.loads(out.stdout)
    want = {
        p.id: "disabled" if declared_code(p) == "would-apply" else declared_code(p) for p in PATCHES
    }
    assert {k: v["code"] for k, v in report["patches"].items()} == want
    needed = [p.id for p in PATCHES if want[p.id] == "disabled" and not p.optional]
    assert out.returncode == (1 if needed else 0), report["problems"]
    assert sorted(p.split(":")[0] for p in report["problems"]) == sorted(needed)


@pytest.mark.parametrize(
    "require",
    ["applied", "fixed", "tested", "applied,tested"],
    # Prefixed ids: a bare "fixed" id would read as the ``fixed`` marker and be skipped.
    ids=lambda r: f"require-{r}",
)
def test_status_require(require: str) -> None:
    out = cli("status", "--json", "--require", require)
    report = json.loads(out.stdout)
    wanted = set(require.split(","))
    codes = {declared_code(p) for p in PATCHES}
    holds = {
        "applied": "would-apply" in codes,
        "fixed": codes - {"not-needed"} == {"upstream-fix-present"},
        "tested": report["tested_build"]["tested"],
    }
    expect = 0 if all(holds[w] for w in wanted) else 1
    assert out.returncode == expect, (require, report["problems"])
    for w in wanted:
        assert any(p.startswith(f"--require {w}") for p in report["problems"]) == (not holds[w])
    if "fixed" in wanted and not holds["fixed"]:  # it names the rows still patched here
        unfixed = [p.id for p in PATCHES if declared_code(p) == "would-apply"]
        line = next(p for p in report["problems"] if p.startswith("--require fixed"))
        assert line.endswith(", ".join(unfixed)), line


def test_status_require_unknown_value_is_a_usage_error() -> None:
    out = cli("status", "--require", "sometimes")
    assert out.returncode == 2 and "unknown requirement" in out.stderr


@pytest.fixture(scope="module")
def verified() -> dict:
    """``vllm-hsfix verify --device cpu --json`` on the release, run once."""
    out = cli("verify", "--device", "cpu", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0, report
    return report


def test_verify_cpu_json_passes_on_the_real_release(verified: dict) -> None:
    assert verified["ok"] is True and verified["device"] == "cpu"
    assert "scatter bfloat16 contiguous" in [c["check"] for c in verified["checks"]]
    # Every row of the register, judged on the patches as they are in this process.
    assert set(verified["hazards"]) == {
        "abort-before-scheduling", "drafter-skip", "prefix-cache-slicing",
        "aux-final-layer-dropped", "torn-files", "torn-files-in-step", "every-rank-writes",
        "cpu-amx-gdn-conv-state", "cpu-amx-gdn-stale-tiles", "nested-text-config",
        "hidden-cache-dtype", "draft-column", "no-new-blocks", "next-token-first-column",
        "chunked-prefill-refused",
    }  # fmt: skip


def _connector_checks(report: dict) -> list:
    return [c.get("skipped") for c in report["checks"] if c["check"].startswith("connector group")]


@pytest.mark.applies("hidden-group-block-size")
def test_verify_checks_the_patched_connector(verified: dict) -> None:
    assert _connector_checks(verified) == [None]
    assert verified["patches"]["scatter-clamp"]["status"] == "applied"


@pytest.mark.fixed_upstream("hidden-group-block-size")
def test_verify_checks_upstreams_connector(verified: dict) -> None:
    assert _connector_checks(verified) == [None]
    assert verified["patches"]["scatter-clamp"]["status"] == "skipped"


@pytest.mark.hazard("prefix-cache-slicing", "torn-files-in-step")  # 0.17-0.23
def test_verify_leaves_out_the_connector_before_it_reads_its_block_size(verified: dict) -> None:
    assert _connector_checks(verified) == []
    assert verified["patches"]["scatter-clamp"]["status"] == "applied"


# The hazards' states, written by hand from the hazard table, per range of releases.
@pytest.mark.parametrize(
    "expected",
    [
        pytest.param(
            {"abort-before-scheduling": "patched", "drafter-skip": "not-affected"},
            marks=pytest.mark.applies("hidden-group-block-size"),  # 0.24.x
        ),
        pytest.param(
            {"abort-before-scheduling": "patched", "drafter-skip": "patched"},
            marks=pytest.mark.hazard("drafter-skip"),  # 0.25-0.28
        ),
        pytest.param(
            {"prefix-cache-slicing": "patched", "drafter-skip": "not-affected"},
            marks=pytest.mark.hazard("prefix-cache-slicing"),  # 0.22-0.23
        ),
        pytest.param(
            {"abort-before-scheduling": "fixed-upstream", "drafter-skip": "fixed-upstream"},
            marks=pytest.mark.fixed_upstream("abort-before-scheduling"),  # 0.31 on
        ),
    ],
)
def test_verify_names_the_releases_hazard_states(verified: dict, expected: dict) -> None:
    states = {k: v["state"] for k, v in verified["hazards"].items()}
    assert {k: states[k] for k in expected} == expected


def test_verify_cuda_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CUDA path is tested in tests/gpu/test_gpu.py")
    out = cli("verify", "--device", "cuda", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 2
    assert "no CUDA GPU is available" in report["error"]
    auto = cli("verify", "--json")  # auto falls back to the CPU and passes
    assert auto.returncode == 0 and json.loads(auto.stdout)["device"] == "cpu"


def test_verify_without_vllm_cannot_run() -> None:
    out = cli("verify", "--json", env=clean_env(PYTHONPATH=None))
    assert out.returncode == 2
    assert "not installed" in json.loads(out.stdout)["error"]
    text = cli("verify", env=clean_env(PYTHONPATH=None))
    assert text.returncode == 2 and "result: NOT verified" in text.stdout
    assert "known hazards" not in text.stdout  # no header over nothing


# Each subcommand's --help: its exit codes, and a word on every option.
HELP = {
    "status": ["exit codes: 0", "1 a row this release", "2 no vLLM", "--json  ", "document"],
    "verify": [
        "exit codes: 0 verified",
        "1 a check failed",
        "2 cannot run",
        "where the checks run",
    ],
    "run": ["exit codes: the command's own", "127", "the command to run"],
    "bootstrap-dir": ["exit codes: 0"],
    "audit": ["exit codes: 0 no corrupt file", "1 at least one corrupt", "2 usage"],
    "repair": ["exit codes: 0 every targeted", "2 usage", "--model MODEL_DIR [--aux"],
}


@pytest.mark.parametrize("sub", sorted(HELP))
def test_each_subcommands_help_lists_its_exit_codes(sub: str) -> None:
    out = cli(sub, "--help")
    text = " ".join(out.stdout.split())  # argparse wraps lines where it likes
    assert out.returncode == 0
    missing = [w for w in HELP[sub] if " ".join(w.split()) not in text]
    assert missing == [], out.stdout
    assert "141 the reader of stdout went away" in text or sub in ("run", "bootstrap-dir")


def test_run_without_a_command_is_a_usage_error() -> None:
    out = cli("run")
    assert out.returncode == 2 and "no command given" in out.stderr


def test_run_passes_the_exit_code_through(tmp_path: Path) -> None:
    out = cli("run", "--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert out.returncode == 7


def test_bootstrap_dir_holds_the_sitecustomize() -> None:
    out = cli("bootstrap-dir")
    assert os.path.isfile(os.path.join(out.stdout.strip(), "sitecustomize.py"))
