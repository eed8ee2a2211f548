"""One activation: ``activation.py CASE [ARG]`` imports vllm_hsfix and vLLM's targets in
the order its test is about and prints one JSON line."""

from __future__ import annotations

import importlib
import json
from typing import Any

from support.children import CONNECTOR_MODULE, MODEL_MODULE, main

RUNNER = "vllm.v1.worker.cpu_model_runner"
TARGETS = (MODEL_MODULE, CONNECTOR_MODULE, RUNNER, "vllm.entrypoints.cli.main")


def import_targets() -> None:
    for name in TARGETS:
        importlib.import_module(name)


def depths() -> dict[str, int]:
    """How many of our wrappers each target carries (the release's 0.24.0 targets)."""

    def depth(obj: Any) -> int:
        n = 0
        while getattr(obj, "hsfix_patch", None) is not None:
            n, obj = n + 1, obj.__wrapped__
        return n

    model = importlib.import_module(MODEL_MODULE)
    conn = vars(importlib.import_module(CONNECTOR_MODULE).ExampleHiddenStatesConnector)
    runner = vars(importlib.import_module(RUNNER).CPUModelRunner)
    return {
        "basic_cache": depth(model.basic_cache),
        "__init__": depth(conn["__init__"]),
        "register_kv_caches": depth(conn["register_kv_caches"]),
        "_zero_block_ids": depth(runner["_zero_block_ids"]),
    }


def patches(field: str) -> dict[str, str]:
    import vllm_hsfix

    return {k: v[field] for k, v in vllm_hsfix.status()["patches"].items()}


def after_import() -> list[Any]:
    import vllm_hsfix

    import_targets()
    return [patches("status"), depths(), vllm_hsfix.status()["activated_by"]]


def every_path(order: str) -> list[Any]:
    """``order``: "targets-first" or "package-first"; then the import, vLLM's plugin
    call, two ``apply()`` and our plugin function, each once."""
    if order == "targets-first":
        import_targets()
    vllm_hsfix = importlib.import_module("vllm_hsfix")  # before vLLM's plugin module
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vllm_hsfix.apply()
    vllm_hsfix.apply()
    import _vllm_hsfix_plugin

    _vllm_hsfix_plugin.register()
    import_targets()
    return [depths(), vllm_hsfix.status()["activated_by"], patches("status")]


def threads() -> dict[str, int]:
    import threading

    import_targets()
    import vllm_hsfix

    barrier = threading.Barrier(8)

    def go() -> None:
        barrier.wait()
        vllm_hsfix.apply()

    started = [threading.Thread(target=go) for _ in range(8)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    return depths()


def codes() -> list[Any]:
    import vllm_hsfix  # noqa: F401

    import_targets()
    return [depths(), patches("code")]


def failing_detect() -> list[Any]:
    """``detect.detect`` raises inside activation: the error stays in the records, or
    (strict mode) reaches the import of a target."""
    import vllm_hsfix.detect as d

    def broken(*a: Any, **k: Any) -> None:
        raise RuntimeError("forced failure inside activation")

    d.detect = broken  # type: ignore[assignment]
    try:
        import_targets()
    except Exception as exc:
        return [f"{type(exc).__name__}: {exc}", None]  # status() would raise again
    return [None, patches("code")]


def failing_plugin() -> str | None:
    import vllm_hsfix._lazy as lazy

    def broken(*args: Any) -> None:
        raise RuntimeError("forced failure in the plugin")

    lazy.activate = broken  # type: ignore[assignment]
    import _vllm_hsfix_plugin

    try:
        _vllm_hsfix_plugin.register()
    except BaseException as exc:
        return type(exc).__name__
    return None


if __name__ == "__main__":
    print(json.dumps(main(globals())))
