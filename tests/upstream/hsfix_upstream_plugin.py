"""pytest plugin of the ``upstream`` row: ``import vllm_hsfix`` before vLLM's test files,
as a user's script does. ``VLLM_HSFIX_UPSTREAM_SHIMS`` (JSON ``{module: [names]}``) binds
names a test file imports but this release lacks to a placeholder that raises on use;
``VLLM_HSFIX_UPSTREAM_STATUS`` (a path) gets vllm-hsfix's status at session end."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import vllm_hsfix

SHIMS = "VLLM_HSFIX_UPSTREAM_SHIMS"
STATUS = "VLLM_HSFIX_UPSTREAM_STATUS"


class Absent:
    """Stands for a name the installed vLLM does not have; any use raises."""

    def __init__(self, where: str) -> None:
        object.__setattr__(self, "_where", where)

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(
            f"{self._where} does not exist in the installed vLLM (bound by vllm-hsfix's "
            "upstream runner only so the test file imports; a test using it cannot run here)"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.__getattr__("__call__")

    def __repr__(self) -> str:
        return f"<absent {self._where}>"


def bound_shims() -> list[str]:
    bound = []
    for module_name, names in json.loads(os.environ.get(SHIMS) or "{}").items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                setattr(module, name, Absent(f"{module_name}.{name}"))
                bound.append(f"{module_name}.{name}")
    return bound


def pytest_configure(config: Any) -> None:
    config._hsfix_shims = bound_shims()


def pytest_report_header(config: Any) -> list[str]:
    st = vllm_hsfix.status()
    lines = [f"vllm-hsfix {st['vllm_hsfix']}: disabled={st['config']['disabled']}"]
    if config._hsfix_shims:
        lines.append(f"placeholders for names this vLLM lacks: {config._hsfix_shims}")
    return lines


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(STATUS)
    if path:
        st = vllm_hsfix.status()
        patches = {k: v.get("status") for k, v in st.get("patches", {}).items()}
        with open(path, "w") as fh:
            json.dump({"patches": patches, "shims": session.config._hsfix_shims}, fh)
