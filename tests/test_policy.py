"""One decision for ``status``, ``verify`` and strict mode (``views.not_in_place``): one
table of settings, each run through all three in fresh processes on the real release."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import clean_env, run
from support.commands import cli

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


def strict_import(env: dict[str, str]) -> tuple[int, str]:
    """Import vLLM's scatter-clamp target with vllm-hsfix active, in strict mode."""
    target = by_id("scatter-clamp").module
    code = f"import vllm_hsfix, importlib; importlib.import_module({target!r})"
    out = run([sys.executable, "-c", code], clean_env(VLLM_HSFIX_STRICT="1", **env))
    return out.returncode, out.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_status_verify_and_strict_take_one_decision(case: str) -> None:
    env, named = CASES[case]
    status = cli("status", "--json", env=clean_env(**env))
    problems = json.loads(status.stdout)["problems"]
    verify = cli("verify", "--device", "cpu", env=clean_env(**env))
    strict_code, strict_err = strict_import(env)
    if not named:
        assert (status.returncode, problems) == (0, [])
        assert verify.returncode == 0 and "result: verified" in verify.stdout, verify.stdout
        assert strict_code == 0, strict_err[-3000:]
        return
    assert status.returncode == 1
    assert verify.returncode == 1 and "result: NOT verified" in verify.stdout, verify.stdout
    assert strict_code == 1 and "HsfixError: strict mode" in strict_err, strict_err[-3000:]
    for pid in named:
        assert any(p.startswith(f"{pid}: ") for p in problems), problems
        assert f"{pid}: " in verify.stdout.split("result:")[0]
        assert f"{pid}: " in strict_err
