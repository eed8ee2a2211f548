"""The list of vLLM's own tests the ``upstream`` row runs (tests/upstream/upstream_tests.toml)
agrees with the patch table: every suite names real patches, runs "patched" only on
releases those patches cover and "fixed" only where upstream's fix ships, and every
per-test exception names a listed test and says why. Static: no torch, no vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_hsfix.patches import PATCH_IDS, by_id
from vllm_hsfix.releases import key as release_key

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+ (the driver's Python)")
UPSTREAM = Path(__file__).resolve().parent / "upstream"
SUITES: list[dict[str, Any]] = tomllib.loads((UPSTREAM / "upstream_tests.toml").read_text())[
    "suite"
]


def test_the_driver_and_its_plugin_are_there() -> None:
    root = UPSTREAM.parent.parent
    assert (root / "scripts" / "upstream_tests.py").is_file()
    assert (UPSTREAM / "hsfix_upstream_plugin.py").is_file()


@pytest.mark.parametrize("suite", SUITES, ids=[s["id"] for s in SUITES])
def test_suite_agrees_with_the_patch_table(suite: dict[str, Any]) -> None:
    assert suite["patches"] and set(suite["patches"]) <= set(PATCH_IDS)
    assert suite["tests"] and len(set(suite["tests"])) == len(suite["tests"])
    assert suite["patched"], "a suite runs on at least one release the patch covers"
    for pid in suite["patches"]:
        row = by_id(pid)
        for release in suite["patched"]:
            assert release_key(row.first) <= release_key(release) < release_key(row.fixed_in)
        for release in suite["fixed"]:
            assert release_key(release) >= release_key(row.fixed_in)
    kind, _, spec = suite["source"].partition(":")
    assert kind in ("sdist", "github")
    if kind == "sdist":  # the release that carries the fix (and its tests)
        assert all(release_key(spec) >= release_key(by_id(p).fixed_in) for p in suite["patches"])
    else:
        assert "@" in spec and len(spec.split("@", 1)[1]) == 40, "a full commit: immutable"
    for test, why in suite.get("unpatched_passes", {}).items():
        assert test in suite["tests"] and why.strip()
    for key, why in suite.get("not_runnable", {}).items():
        test, release = key.split(" @ ")
        assert test in suite["tests"] and why.strip()
        assert release in suite["patched"] + suite["fixed"]
    for module, names in suite.get("shims", {}).items():
        assert module.startswith("vllm.") and names
