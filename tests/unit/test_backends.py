"""``vllm-hsfix status`` knows speculators' backends (hs-connectors) and what reaches each,
expectations read off the installed classes."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
from conftest import clean_env, connector
from support.commands import cli

pytestmark = [pytest.mark.needs_vllm]

pytest.importorskip("hs_connectors", reason="hs-connectors is layered on the main rows")


def overridden(cls: type, base: type) -> set[str]:
    return {
        n
        for n, v in cls.__dict__.items()
        if not n.startswith("__") and n in dir(base) and callable(getattr(cls, n))
    }


def test_the_backends_are_what_status_says_they_are() -> None:
    base = connector().ExampleHiddenStatesConnector
    fp8 = importlib.import_module(
        "hs_connectors.fp8_hidden_states_connector"
    ).FP8HiddenStatesConnector
    mooncake = importlib.import_module(
        "hs_connectors.mooncake_hidden_states_connector"
    ).MooncakeHiddenStatesConnector
    assert issubclass(fp8, base) and overridden(fp8, base) == {"_write_tensors"}
    assert not issubclass(mooncake, base)
    # mooncake finds the hidden group's block size itself (PR 46301's fix, its own code)
    assert "HiddenStateCacheSpec" in inspect.getsource(mooncake)
    proc = cli("status", "--json", env=clean_env(), timeout=120)
    report = json.loads(proc.stdout)
    found = report["hs_connectors"]
    assert found["version"] == importlib.metadata.version("hs-connectors")
    applying = {p for p, v in report["patches"].items() if v["code"] == "would-apply"}
    b = found["backends"]
    assert set(b["file"]["patches"]) == applying
    assert all(r.startswith("yes") for r in b["file"]["patches"].values())
    if "atomic-writes" in applying:
        assert b["fp8"]["patches"]["atomic-writes"] == "yes (subclass's own method wrapped)"
    for pid in applying & {"hidden-group-block-size", "abort-before-scheduling"}:
        assert b["fp8"]["patches"][pid] == "yes (inherited)"
        assert b["mooncake"]["patches"][pid].startswith("no")
    if "scatter-clamp" in applying:  # the model's scatter runs under every connector
        assert b["mooncake"]["patches"]["scatter-clamp"] == "yes"
    human = cli("status", env=clean_env(), timeout=None).stdout
    assert "hs-connectors" in human and "fp8" in human and "mooncake" in human
