"""``import vllm_hsfix`` must stay cheap where vLLM is never used."""

from __future__ import annotations

import pytest
from conftest import last_json, run_py

HEAVY = ("vllm", "torch", "wrapt", "packaging", "importlib.metadata", "vllm_hsfix.runtime")


def test_import_loads_nothing_heavy() -> None:
    out = run_py(
        f"""
        import json, sys
        import vllm_hsfix
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))
        """
    )
    assert out.returncode == 0, out.stderr
    assert last_json(out.stdout) == []


@pytest.mark.needs_vllm
def test_activation_waits_for_vllm_import() -> None:
    out = run_py(
        """
        import json, sys
        import vllm_hsfix
        before = "vllm_hsfix.runtime" in sys.modules
        import vllm  # the watcher fires here
        print(json.dumps([before, "vllm_hsfix.runtime" in sys.modules,
                          vllm_hsfix.status()["activated_by"]]))
        """
    )
    before, after, sources = last_json(out.stdout)
    assert (before, after) == (False, True)
    assert sources == ["import", "vllm-import"]
