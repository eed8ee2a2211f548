"""``refuse-config``: the register and the checks agree, ``drafter-skip``'s arithmetic
matches hand-worked cases, and the real connector in the scheduler role warns (strict:
fails) exactly where the release has the hazard, never as worker or after ``unapply()``."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import CACHE, RELEASE, clean_env, last_json
from support.commands import cli
from support.procs import child

from vllm_hsfix import hazards

# Which hazard a trigger config must raise, by release line; others stay silent.
EXPECTED = dict.fromkeys(["0.25", "0.26", "0.27", "0.28"], "drafter-skip")
NO_PREFIX = "--no-enable-prefix-caching"
# Tests of the installed release: one where the register has a refuse-config hazard,
# the other where it has none (conftest reads the markers).
ROWS = ("drafter-skip",)
with_hazard = pytest.mark.hazard(*ROWS)
without_hazard = pytest.mark.no_hazard(*ROWS)
# A trigger's length minus one: drafter-skip is silent there; its length advice.
OTHER_LENGTH_WARNINGS = {"drafter-skip": 0}
LENGTH_ADVICE = {"drafter-skip": "--max-model-len 65"}


def expected_hazard(release: str | None) -> str | None:
    return EXPECTED.get(".".join((release or "0.0").split(".")[:2]))


def installed_hazard() -> str:
    """The hand-written table's hazard of the installed release (the markers agree)."""
    want = expected_hazard(RELEASE)
    assert want is not None, f"the register has a refuse-config hazard on {RELEASE}, EXPECTED none"
    return want


@pytest.mark.parametrize(
    ("release", "ids"),
    [
        ("0.21.0", ()),
        ("0.22.0", ()),  # prefix-cache-slicing is patched there (slots-from-blocks)
        ("0.23.0", ()),
        ("0.24.0", ()),
        ("0.25.0", ("drafter-skip",)),
        ("0.28.0", ("drafter-skip",)),
        ("0.29.0", ()),
        (None, ()),
        ("not-a-version", ()),
    ],
)
def test_rows_checked_per_release(release: str | None, ids: tuple[str, ...]) -> None:
    assert tuple(h.id for h in hazards.refuse_config(release)) == ids


@pytest.mark.parametrize(
    ("hazard", "release", "active", "state"),
    [
        ("drafter-skip", "0.25.0", True, "checked-at-start"),
        ("drafter-skip", "0.25.0", False, "exposed"),
        ("drafter-skip", "0.24.0", True, "not-affected"),
        ("drafter-skip", "0.29.0", True, "fixed-upstream"),
    ],
)
def test_assess_a_refuse_config_hazard(hazard: str, release: str, active: bool, state: str) -> None:
    got = hazards.assess(hazards.by_id(hazard), release, {}, active)
    assert got["state"] == state, got
    assert got["action"] == "refuse-config"
    if state in ("checked-at-start", "exposed"):
        assert NO_PREFIX in got["reason"], got


def status_hazards(disabled: bool) -> tuple[dict[str, Any], str]:
    """``vllm-hsfix status`` (no vLLM import), JSON and text: the hazards, the text; the
    exit code does not change for a refuse-config hazard, other rows are not there."""
    env = clean_env(**({"VLLM_HSFIX_DISABLE": "1"} if disabled else {}))
    out = cli("status", "--json", env=env, timeout=120)
    text = cli("status", env=env, timeout=120)
    assert text.returncode == out.returncode
    got = json.loads(out.stdout)["hazards"]
    for hid in set(hazards.CHECKS) - {expected_hazard(RELEASE)}:
        assert got[hid]["state"] in ("not-affected", "fixed-upstream"), (hid, got[hid])
    return got, text.stdout


@pytest.mark.needs_vllm
@with_hazard
@pytest.mark.parametrize("disabled", [False, True])
def test_status_names_the_check_on_the_installed_release(disabled: bool) -> None:
    """The release's refuse-config hazard is ``checked-at-start`` with the setting in its
    reason, ``exposed`` when vllm-hsfix is off."""
    got, text = status_hazards(disabled)
    want = installed_hazard()
    state = "exposed" if disabled else "checked-at-start"
    assert got[want]["state"] == state and NO_PREFIX in got[want]["reason"], got[want]
    line = re.search(rf"^  {want} +checked-at-start +a WARNING", text, re.M)
    assert (line is None) is disabled, text


@pytest.mark.needs_vllm
@without_hazard
@pytest.mark.parametrize("disabled", [False, True])
def test_status_names_no_check_where_the_release_has_none(disabled: bool) -> None:
    assert expected_hazard(RELEASE) is None, RELEASE
    status_hazards(disabled)


# Worked out by hand: n = 1 pads a one-token remainder to 2 when m + 2 <= L and the
# drafter needs m + 2 + 1 <= L, so only m = L - 2 skips; n = 2 pads to 3 (m + 3 <= L)
# and needs m + 3 + 2 <= L: m in {L - 4, L - 3}. m is a positive multiple of the block.
@pytest.mark.parametrize(
    ("max_len", "block", "n", "lengths"),
    [
        (66, 16, 1, [64]),
        (65, 16, 1, []),
        (67, 16, 1, []),
        (34, 16, 1, [32]),
        (2050, 16, 1, [2048]),
        (4098, 32, 1, [4096]),
        (4097, 32, 1, []),
        (68, 16, 2, [64]),
        (67, 16, 2, [64]),
        (66, 16, 2, []),
        (66, 1, 1, [64]),
        (2, 16, 1, []),
    ],
)
def test_drafter_skip_lengths(max_len: int, block: int, n: int, lengths: list[int]) -> None:
    assert hazards.drafter_skip_lengths(max_len, block, n) == lengths


def fake_config(prefix: bool, max_len: int, block: int, n: int = 1) -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix, block_size=block),
        model_config=SimpleNamespace(max_model_len=max_len),
        speculative_config=SimpleNamespace(num_speculative_tokens=n),
    )


def test_drafter_skip_names_the_settings() -> None:
    # kv_cache_config None: the global block size (what one group gives on any release).
    found = hazards.drafter_skip(fake_config(True, 66, 16), None)
    assert found is not None
    assert NO_PREFIX in found and "--max-model-len 65" in found, found
    assert hazards.drafter_skip(fake_config(False, 66, 16), None) is None
    assert hazards.drafter_skip(fake_config(True, 65, 16), None) is None
    # Block size 1: every max_model_len has the trigger; only prefix caching off helps.
    found = hazards.drafter_skip(fake_config(True, 66, 1), None)
    assert found is not None and NO_PREFIX in found and "--max-model-len" not in found, found


ALL_CASES = {
    "trigger": (66, True, "SCHEDULER"),  # 66 - 2 = 64 = four blocks of 16, prefix caching on
    "trigger-worker": (66, True, "WORKER"),
    "no-prefix-caching": (66, False, "SCHEDULER"),
    "other-length": (65, True, "SCHEDULER"),
}


def run_case(tmp_path: Any, cases: dict[str, tuple[int, bool, str]], **env: str) -> Any:
    """``support/children/connector_start.py``'s connectors, one per case."""
    from hsfix_demo import tiny_model

    model = tiny_model.build(CACHE / "models" / "dense", "dense")
    args = (model, tmp_path, json.dumps(cases))
    proc = child("connector_start.py", *args, env=clean_env(**env), timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return last_json(proc.stdout)


def started(tmp_path: Any) -> dict[str, Any]:
    """Every case of ``ALL_CASES``: each connector built; never a warning in the worker
    role, with prefix caching off, or after ``unapply()``."""
    got = run_case(tmp_path, ALL_CASES)
    print(json.dumps(got, indent=1))
    assert all(got[c]["error"] is None for c in ALL_CASES), got
    assert got["trigger-worker"]["warnings"] == [], got["trigger-worker"]
    assert got["after-unapply"] == {"warnings": [], "error": None, "prefix": True}, got
    assert got["no-prefix-caching"]["warnings"] == [], got["no-prefix-caching"]
    return got


@pytest.mark.needs_vllm
@with_hazard
def test_connector_start_warns_where_the_release_has_the_hazard(tmp_path: Any) -> None:
    got, want = started(tmp_path), installed_hazard()
    (warning,) = got["trigger"]["warnings"]
    assert warning.startswith(f"hazard {want} on vLLM {RELEASE}"), warning
    assert NO_PREFIX in warning and "enable_prefix_caching=False" in warning, warning
    assert LENGTH_ADVICE[want] in warning, warning
    assert got["status"]["checked"] == [want], got["status"]
    assert set(got["status"]["triggered"]) == {want}, got["status"]
    other = got["other-length"]["warnings"]
    assert len(other) == OTHER_LENGTH_WARNINGS[want], other


@pytest.mark.needs_vllm
@without_hazard
def test_connector_start_is_silent_where_the_release_has_no_hazard(tmp_path: Any) -> None:
    got = started(tmp_path)
    assert all(got[c]["warnings"] == [] for c in ALL_CASES), got
    assert got["status"] == {"checked": [], "triggered": {}}, got["status"]


@pytest.mark.needs_vllm
@with_hazard
def test_strict_mode_refuses_to_start(tmp_path: Any) -> None:
    """The trigger fails the connector; prefix caching off and after ``unapply()`` do not."""
    cases = {"trigger": ALL_CASES["trigger"], "no-prefix-caching": ALL_CASES["no-prefix-caching"]}
    got = run_case(tmp_path, cases, VLLM_HSFIX_STRICT="1")
    print(json.dumps(got, indent=1))
    assert got["no-prefix-caching"]["error"] is None and got["after-unapply"]["error"] is None
    err, want = got["trigger"]["error"], installed_hazard()
    assert err is not None and err["type"] == "HsfixError", err
    assert f"hazard {want} on vLLM {RELEASE}" in err["message"], err
    assert NO_PREFIX in err["message"] and "VLLM_HSFIX_STRICT=1" in err["message"], err
