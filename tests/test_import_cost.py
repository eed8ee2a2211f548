"""What ``import vllm_hsfix`` loads, and when activation happens (the bootstrap imports
the package in every Python process of an image). Speed: ``benchmarks/bench_startup.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, clean_env, last_json, run_py

# Everything ``import vllm_hsfix`` may add: not ``typing`` (it pulls ``re``,
# ``collections``...), not ``__future__``. Each entry is paid by every Python process.
ALLOWED = {
    "vllm_hsfix",
    "vllm_hsfix._version",
    "vllm_hsfix.errors",
    "vllm_hsfix.activation",
    "vllm_hsfix._lazy",
}
# What every interpreter has loaded before any user code.
PRELOADED = "import _thread, os, sys"

FRESH = f"""
import json
{PRELOADED}
sys.path.insert(0, {str(ROOT)!r})
before = set(sys.modules)
import vllm_hsfix
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def added_by_import(*flags: str) -> list[str]:
    """Modules ``import vllm_hsfix`` adds in a fresh interpreter started with ``flags``."""
    out = subprocess.run(
        [sys.executable, *flags, "-c", FRESH],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    added: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return added


@pytest.mark.parametrize("flags", [("-S",), ()], ids=["no-site", "site"])
def test_import_adds_only_the_packages_start_up_modules(flags: tuple[str, ...]) -> None:
    """``-S``: no ``site``, so no development install's ``.pth`` (an editable install's
    finder imports ``re``, ``pathlib``...) hides a module the package pulls in; there the
    list is exact. With ``site``: the interpreter as the test environment starts it."""
    added = set(added_by_import(*flags))
    assert added <= ALLOWED, f"import vllm_hsfix also loads {sorted(added - ALLOWED)}"
    assert added == ALLOWED or flags == ()


def test_post_import_hooks_fire_once_after_the_module_body_ran(tmp_path: Path) -> None:
    """``_lazy.when_imported``: after the body, once, not on reload; at once for a
    module already imported; an exception in a hook reaches the import."""
    out = run_py(
        f"""
        import importlib, json, pathlib, sys
        pkg = pathlib.Path({str(tmp_path)!r})
        (pkg / "hsfix_target_a.py").write_text("VALUE = 1\\n")
        (pkg / "hsfix_target_b.py").write_text("VALUE = 2\\n")
        sys.path.insert(0, str(pkg))
        from vllm_hsfix import _lazy
        seen = []
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a", m.VALUE)))
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a2", m.VALUE)))
        import hsfix_target_a
        importlib.reload(hsfix_target_a)
        _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("late", m.VALUE)))
        def boom(m):
            raise KeyError("from the hook")
        _lazy.when_imported("hsfix_target_b", boom)
        try:
            import hsfix_target_b
            raised = None
        except KeyError as exc:
            raised = str(exc)
        loader = type(hsfix_target_a.__loader__).__name__
        print(json.dumps([seen, raised, loader, _lazy.errors()]))
        """
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen, raised, loader, errors = last_json(out.stdout)
    assert seen == [["a", 1], ["a2", 1], ["late", 1]]
    assert raised == "'from the hook'"
    assert loader == "SourceFileLoader"  # no trace of the watcher's loader is left
    assert errors == []
