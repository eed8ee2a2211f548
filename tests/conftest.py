"""Shared fixtures. The suite runs inside an environment built by scripts/vllm_env.py,
with one real vLLM release first on PYTHONPATH; ``scripts/run_tests.py`` runs it per release."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.children import CONNECTOR_MODULE, MODEL_MODULE

from vllm_hsfix import detect, releases
from vllm_hsfix.patches.hooks import Hooks

ROOT = Path(__file__).resolve().parent.parent
INSTALL = detect.detect()
RELEASE = INSTALL.release
CACHE = Path(os.environ.get("VLLM_HSFIX_CACHE", Path.home() / ".cache" / "vllm-hsfix"))


def connector() -> Any:
    """vLLM's hidden-states connector module, imported (and so patched where active)."""
    return importlib.import_module(CONNECTOR_MODULE)


# Hooks that do nothing, for a patch applied by hand in a test.
NO_HOOKS = Hooks(on_failure=lambda pid, exc: None)


def declared_code(patch: Any, release: str | None = None, cpu_build: bool | None = None) -> str:
    """The ``status`` code a row declares for a release and platform, through
    ``plan.release_gate`` (the one reading of a row's range): "would-apply" where the
    gates leave it to the code's shape, else the gate's code."""
    from vllm_hsfix import config, plan

    release = release or RELEASE or "0.0.0"
    cpu = INSTALL.cpu_build if cpu_build is None else cpu_build
    inst = detect.from_version("vllm", release, None, "metadata", cpu_build=bool(cpu))
    gated = plan.release_gate(patch, inst, config.Config())
    return "would-apply" if gated is None else gated.code.value


def declared(patch: Any, release: str | None = None, cpu_build: bool | None = None) -> str:
    """What a row DECLARES: "applied" where it would apply, else "skipped"."""
    return "applied" if declared_code(patch, release, cpu_build) == "would-apply" else "skipped"


def cli_rows_as_declared(got: dict[str, str]) -> dict[str, str]:
    """``got`` (a process's patch statuses) with the rows on vLLM's CLI module read as
    declared when "on-import": they wait for an import only the ``vllm`` console script
    (and its children) makes. Any other status is kept, so a refusal still shows."""
    from vllm_hsfix.patches import PATCHES

    cli = {p.id for p in PATCHES if p.module.startswith("vllm.entrypoints.cli")}
    want = declared_all()
    return {k: (want[k] if k in cli and v == "on-import" else v) for k, v in got.items()}


def applies(patch_id: str, release: str | None = None) -> bool:
    """The row is declared applied on ``release`` (default: the installed one) here."""
    from vllm_hsfix.patches import by_id

    return declared(by_id(patch_id), release) == "applied"


def fixed_upstream(patch_id: str, release: str | None = None) -> bool:
    """``release`` (default: the installed one) is at or past the row's ``fixed_in``."""
    from vllm_hsfix.patches import by_id

    release, fixed_in = release or RELEASE, by_id(patch_id).fixed_in
    return bool(release and fixed_in) and releases.fixed(release, fixed_in)  # type: ignore[arg-type]


def declared_all(**kw: Any) -> dict[str, str]:
    from vllm_hsfix.patches import PATCHES

    return {p.id: declared(p, **kw) for p in PATCHES}


def pytest_report_header(config: pytest.Config) -> str:
    return f"vllm under test: {INSTALL.distribution} {INSTALL.version} at {INSTALL.location}"


def has_hazard(hazard_id: str) -> bool:
    """The register's range of the hazard holds the installed release."""
    from vllm_hsfix import hazards

    return bool(RELEASE) and hazards.by_id(hazard_id).affects(RELEASE)


def _release_mismatch(item: pytest.Item) -> str | None:
    """Why ``item`` does not concern the installed release: ``applies(id, ...)`` needs
    one of the rows applied, ``fixed_upstream(id, ...)`` every row's fix shipped,
    ``hazard(id, ...)`` one of the register's hazards here, ``no_hazard(id, ...)`` none."""
    for mark in item.iter_markers("applies"):
        if not any(applies(pid) for pid in mark.args):
            return f"needs a release where {' or '.join(mark.args)} applies"
    for mark in item.iter_markers("fixed_upstream"):
        if not all(fixed_upstream(pid) for pid in mark.args):
            return f"needs a release carrying upstream's fix of {', '.join(mark.args)}"
    for mark in item.iter_markers("hazard"):
        if not any(has_hazard(hid) for hid in mark.args):
            return f"needs a release with hazard {' or '.join(mark.args)}"
    for mark in item.iter_markers("no_hazard"):
        if any(has_hazard(hid) for hid in mark.args):
            return f"needs a release without hazard {', '.join(mark.args)}"
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--patch",
        action="append",
        default=[],
        metavar="ID",
        help="only a patch row's tests: its unit's file (tests/patches/test_<unit>.py) and "
        "every test whose applies/fixed_upstream marker names it (repeatable)",
    )


def _not_of_patches(item: pytest.Item, ids: list[str]) -> bool:
    """``item`` is neither in one of the rows' unit files nor marked with one of them."""
    if item.path.parent.name == "patches" and item.path.stem[5:].replace("_", "-") in ids:
        return False
    marks = ("applies", "fixed_upstream")
    return not {a for m in item.iter_markers() if m.name in marks for a in m.args} & set(ids)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from vllm_hsfix.patches import PATCH_IDS

    ids = config.getoption("--patch")
    if set(ids) - set(PATCH_IDS):
        raise pytest.UsageError(f"--patch: no row {sorted(set(ids) - set(PATCH_IDS))}")
    # From the table's ranges: a row that moves moves its tests, in CI and by hand alike.
    keep, drop = [], []
    for item in items:
        mismatch = _release_mismatch(item) or (ids and _not_of_patches(item, ids))
        (drop if mismatch else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    for item in items:
        if "needs_vllm" in item.keywords and not INSTALL.present:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed"))


def clean_env(**extra: str | None) -> dict[str, str]:
    """The current environment without any VLLM_HSFIX_* switch, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HSFIX_")}
    env.pop("VLLM_PLUGINS", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env["VLLM_HSFIX_CACHE"] = str(CACHE)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def run(
    cmd: list[Any],
    env: dict[str, str] | None = None,
    timeout: float | None = 300,
    cwd: str | Path | None = None,
    merge: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (default environment: ``clean_env()``) in a session of its own,
    killed whole after; with ``merge``, stderr goes into stdout (one order of events)."""
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        env=env if env is not None else clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE,
        text=True,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_json(stdout: str, objects_only: bool = False) -> Any:
    """The last line of ``stdout`` that is a JSON document (vLLM prints logs too); with
    ``objects_only``, the last that starts with ``{`` (log lines may start with ``[``)."""
    for raw in reversed(stdout.strip().splitlines()):
        line = raw.strip()
        if objects_only:
            if raw.startswith("{"):
                return json.loads(line)
        elif line.startswith(("{", "[", '"')) or line == "null":
            return json.loads(line)
    raise AssertionError(f"no JSON line in output:\n{stdout[-2000:]}")


@pytest.fixture
def patched() -> Any:
    """vllm-hsfix applied in this process for one test, and reverted after it."""
    import vllm_hsfix

    vllm_hsfix.apply()
    importlib.import_module(MODEL_MODULE)
    importlib.import_module(CONNECTOR_MODULE)
    yield vllm_hsfix
    vllm_hsfix.unapply()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from hsfix_demo import tiny_model

    root = CACHE / "models"
    return {kind: tiny_model.build(root / kind, kind) for kind in ("hybrid", "dense")}
