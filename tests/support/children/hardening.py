"""The patcher under stress: ``hardening.py CASE [ARG]`` runs ``CASE`` and prints one JSON
line; each case imports vllm_hsfix and vLLM in the order its test is about."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from support.children import CONNECTOR_MODULE, MODEL_MODULE, main


def targets() -> tuple[Any, Any]:
    """vLLM's model module and connector module, imported."""
    return importlib.import_module(MODEL_MODULE), importlib.import_module(CONNECTOR_MODULE)


def scatter_problems(model: Any) -> list[str]:
    """The scatter check on the live ``basic_cache``: [] when padding goes to the null block."""
    import torch

    from vllm_hsfix.patches.scatter_clamp import checks as scatter_checks

    case = scatter_checks.scratch_case(device="cpu", dtype=torch.float32)
    return scatter_checks.check_scatter(model.basic_cache, case)


def built_unapplied(hidden_groups: int = 1) -> Any:
    """A connector built on the release's code (vllm-hsfix unapplied) with two hidden-states
    groups, which the fix refuses; the release's ``__init__`` may raise already."""
    import vllm_hsfix
    from vllm_hsfix import checks

    vllm_hsfix.unapply()
    layout, _ = checks.hybrid_layout()
    group, spec = type(layout.kv_cache_groups[2]), layout.kv_cache_groups[2].kv_cache_spec
    for i in range(1, hidden_groups):
        layout.kv_cache_groups.append(group([f"cache_only_layers.{i}"], spec))
    return checks.construct_connector(targets()[1].ExampleHiddenStatesConnector, layout, 528)


def fails_closed() -> list[Any]:
    _, conn = targets()
    import vllm_hsfix
    from vllm_hsfix import checks
    from vllm_hsfix.patches.hidden_group_block_size import fix as connector

    def broken(config: Any) -> None:
        raise RuntimeError("injected fault in group resolution")

    connector.find_hidden_group = broken
    layout, _ = checks.hybrid_layout()
    try:
        checks.construct_connector(conn.ExampleHiddenStatesConnector, layout, 528)
        raised = None
    except Exception as exc:
        raised = [type(exc).__name__, str(exc)]
    rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
    return [raised, rec["status"], rec["reason"]]


def unapply_before_import() -> list[Any]:
    import vllm_hsfix

    vllm_hsfix.unapply()
    model, _ = targets()
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: calls our entry point
    from vllm_hsfix.patches._wrap import ours_in

    st = vllm_hsfix.status()
    before = [
        st["activated_by"],
        {k: v["status"] for k, v in st["patches"].items()},
        ours_in(model.basic_cache) is not None,
        bool(scatter_problems(model)),
    ]
    vllm_hsfix.apply()
    st = vllm_hsfix.status()["patches"]
    return [before, st["scatter-clamp"]["status"], scatter_problems(model)]


def reload_targets() -> list[Any]:
    import vllm_hsfix

    model, conn = targets()

    def statuses() -> dict[str, list[str]]:
        return {k: [v["status"], v["code"]] for k, v in vllm_hsfix.status()["patches"].items()}

    stamped = [vllm_hsfix.status()["provenance"], hasattr(conn, "save_file")]
    importlib.reload(conn)
    after_conn = statuses()
    importlib.reload(model)
    after_both, bug_back = statuses(), bool(scatter_problems(model))
    vllm_hsfix.apply()
    provenance, problems = vllm_hsfix.status()["provenance"], scatter_problems(model)
    return [stamped, after_conn, after_both, bug_back, statuses(), provenance, problems]


def apply_after_connector() -> list[Any]:
    conn = built_unapplied()
    before = conn._block_size
    import vllm_hsfix

    vllm_hsfix.apply()
    rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
    return [before, conn._block_size, rec["status"], rec["reason"]]


def late_apply_ambiguous() -> list[Any]:
    try:
        conn = built_unapplied(hidden_groups=2)  # noqa: F841  (kept alive for apply)
    except Exception as exc:
        return ["init-raised", repr(exc)]
    import vllm_hsfix

    vllm_hsfix.apply()
    rec = vllm_hsfix.status()["patches"]["hidden-group-block-size"]
    cls = vars(targets()[1].ExampleHiddenStatesConnector)
    wrappers = [getattr(cls[n], "hsfix_patch", None) for n in ("__init__", "register_kv_caches")]
    return [rec["status"], rec["reason"], wrappers]


def post_import_hooks(folder: str) -> list[Any]:
    from pathlib import Path

    (Path(folder) / "hsfix_target_a.py").write_text("VALUE = 1\n")
    (Path(folder) / "hsfix_target_b.py").write_text("VALUE = 2\n")
    sys.path.insert(0, folder)
    from vllm_hsfix import _lazy

    seen = []
    _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a", m.VALUE)))
    _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("a2", m.VALUE)))
    a = importlib.import_module("hsfix_target_a")
    importlib.reload(a)
    _lazy.when_imported("hsfix_target_a", lambda m: seen.append(("late", m.VALUE)))

    def boom(m: Any) -> None:
        raise KeyError("from the hook")

    _lazy.when_imported("hsfix_target_b", boom)
    try:
        importlib.import_module("hsfix_target_b")
        raised = None
    except KeyError as exc:
        raised = str(exc)
    return [seen, raised, type(a.__loader__).__name__, _lazy.errors()]


def find_spec() -> list[Any]:
    import importlib.util

    import vllm_hsfix

    found = importlib.util.find_spec("vllm") is not None
    after_find = ["vllm_hsfix.runtime" in sys.modules, "vllm" in sys.modules]
    import vllm

    loaders = [type(vllm.__loader__).__name__, type(vllm.__spec__.loader).__name__]
    sources = vllm_hsfix.status()["activated_by"]
    return [found, after_find, "vllm_hsfix.runtime" in sys.modules, sources, *loaders]


def broken_runtime() -> list[Any]:
    import vllm_hsfix  # noqa: F401

    sys.modules["vllm_hsfix.runtime"] = None  # type: ignore[assignment]  # import raises
    import vllm  # noqa: F401

    from vllm_hsfix import _lazy

    return ["vllm" in sys.modules, _lazy.errors()]


def fork_with_lock_held() -> list[int]:
    import os
    import threading

    from vllm_hsfix._lazy import LOCK

    held, release, taken = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with LOCK:
            held.set()
            release.wait(10)

    def take() -> None:
        with LOCK:
            taken.set()

    threading.Thread(target=holder, daemon=True).start()
    held.wait(5)
    pid = os.fork()
    if pid == 0:
        threading.Thread(target=take, daemon=True).start()
        os._exit(0 if taken.wait(3) else 7)
    _, status = os.waitpid(pid, 0)
    release.set()
    return [os.waitstatus_to_exitcode(status)]


def app_logging() -> str:
    import logging

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP|%(name)s|%(message)s")
    import vllm_hsfix  # noqa: F401

    targets()
    return "done"


def verify_broken_wrapper() -> list[Any]:
    import vllm_hsfix  # noqa: F401

    _, conn = targets()
    from vllm_hsfix import verify
    from vllm_hsfix.patches._wrap import HsfixWrapper

    # A broken wrapper: carries our mark, wraps once, but never resolves the group.
    cls = conn.ExampleHiddenStatesConnector
    original = cls.__dict__["__init__"].__wrapped__
    cls.__init__ = HsfixWrapper(original, lambda w, i, a, k: w(*a, **k), "hidden-group-block-size")
    code, report = verify.run("cpu")
    checked = next(c for c in report["checks"] if c["check"].startswith("connector"))
    return [code, checked["ok"], checked["problems"]]


def later_wrapper() -> list[Any]:
    import functools

    import vllm_hsfix

    model, _ = targets()
    calls = []
    ours = model.basic_cache

    @functools.wraps(ours)
    def theirs(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return ours(*args, **kwargs)

    model.basic_cache = theirs
    vllm_hsfix.unapply()
    reason = vllm_hsfix.status()["patches"]["scatter-clamp"]["reason"]
    after_unapply = [model.basic_cache is theirs, bool(scatter_problems(model)), len(calls), reason]
    vllm_hsfix.apply()
    return [after_unapply, model.basic_cache is theirs, scatter_problems(model), len(calls)]


def foreign_cpu_zeroing() -> list[Any]:
    import vllm.v1.worker.cpu_model_runner as runner_module

    def _zero_block_ids(self: Any, block_ids: Any) -> None:  # a foreign no-op
        return None

    runner_module.CPUModelRunner._zero_block_ids = _zero_block_ids
    from vllm_hsfix import verify

    code, report = verify.run("cpu")
    return [code, report.get("error"), report["patches"]["cpu-zero-blocks"]["status"]]


if __name__ == "__main__":
    print(json.dumps(main(globals())))
