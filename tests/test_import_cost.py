"""When activation happens: the post-import hooks the package arms at import (the
bootstrap imports it in every Python process of an image). What ``import vllm_hsfix``
loads, and what it costs: ``benchmarks/bench_startup.py``."""

from __future__ import annotations

from pathlib import Path

from conftest import last_json, run_py


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
