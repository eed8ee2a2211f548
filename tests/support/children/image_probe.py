"""What an image's interpreter holds, read inside it; standalone (the image's Python has
no tests on its path). ``image_probe.py CASE [ARG ...]`` prints one JSON line."""

import importlib
import importlib.metadata as md
import importlib.util
import json
import sys
import sysconfig


def snapshot() -> dict:
    """Each distribution: its version and a digest of its RECORD (its files)."""
    import hashlib

    out = {}
    for d in md.distributions():
        record = (d.read_text("RECORD") or "").encode()
        out[d.metadata["Name"].lower().replace("_", "-")] = [
            d.version,
            hashlib.sha256(record).hexdigest(),
        ]
    return out


def origin(module: str) -> str:
    return importlib.util.find_spec(module).origin


def plugins() -> list:
    """The entry points vLLM loads in every process."""
    return [e.value for e in md.entry_points(group="vllm.general_plugins")]


def purelib() -> str:
    return sysconfig.get_paths()["purelib"]


def versions(*names: str) -> list:
    return [importlib.import_module(n).__version__ for n in names]


def worker(*targets: str) -> None:
    """No code change: only vLLM's own plugin loading, then the targets' imports."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for name in targets:
        importlib.import_module(name)


if __name__ == "__main__":
    print(json.dumps(globals()[sys.argv[1]](*sys.argv[2:])))
