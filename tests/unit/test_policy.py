"""One decision for ``status``, ``verify``, strict mode and the live ``status()``
(``views.not_in_place``): one table of settings, each run through all four in fresh
processes on the real release."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import clean_env, last_json
from support.commands import cli
from support.procs import child

from vllm_hsfix.patches import by_id

# The rows PR 46301's fix is: needed wherever these tests run.
pytestmark = [
    pytest.mark.needs_vllm,
    pytest.mark.applies("scatter-clamp"),
    pytest.mark.applies("hidden-group-block-size"),
]

# settings -> the rows that must be named as not in place ([]: the fix applies).
CASES = {
    "defaults": ({}, []),
    "pr-46301-off": (
        {"VLLM_HSFIX_DISABLED_PATCHES": "scatter-clamp,hidden-group-block-size"},
        ["scatter-clamp", "hidden-group-block-size"],
    ),
    # An optional row (beyond upstream: no data is wrong without it) may be turned off.
    "optional-off": ({"VLLM_HSFIX_DISABLED_PATCHES": "atomic-writes"}, []),
    "version-unreadable": ({"VLLM_HSFIX_VLLM_VERSION": "garbage"}, ["scatter-clamp"]),
}


def import_target(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """vLLM's scatter-clamp target imported with vllm-hsfix active in a fresh process,
    which prints its live ``status()`` (support/children/import_status.py)."""
    return child("import_status.py", by_id("scatter-clamp").module, env=clean_env(**env))


@pytest.mark.parametrize("case", sorted(CASES))
def test_status_verify_and_strict_take_one_decision(case: str) -> None:
    env, named = CASES[case]
    status = cli("status", "--json", env=clean_env(**env))
    static = json.loads(status.stdout)
    problems = static["problems"]
    verify = cli("verify", "--device", "cpu", env=clean_env(**env))
    strict = import_target({"VLLM_HSFIX_STRICT": "1", **env})
    strict_code, strict_err = strict.returncode, strict.stderr
    own = import_target(env)
    live, err = last_json(own.stdout), own.stderr
    # One model: the live view's rows carry the static view's entry, key for key.
    assert {p: sorted(e) for p, e in live["patches"].items()} == {
        p: sorted(e) for p, e in static["patches"].items()
    }
    if not named:
        assert (status.returncode, problems, live["problems"]) == (0, [], [])
        assert verify.returncode == 0 and "result: verified" in verify.stdout, verify.stdout
        assert strict_code == 0, strict_err[-3000:]
        return
    assert status.returncode == 1 and live["ok"] is False, err[-3000:]
    assert verify.returncode == 1 and "result: NOT verified" in verify.stdout, verify.stdout
    assert strict_code == 1 and "HsfixError: strict mode" in strict_err, strict_err[-3000:]
    for pid in named:
        assert any(p.startswith(f"{pid}: ") for p in problems), problems
        assert any(p.startswith(f"{pid}: ") for p in live["problems"]), live["problems"]
        assert f"{pid}: " in verify.stdout.split("result:")[0]
        assert f"{pid}: " in strict_err
