"""``cpu-dist-name``: ``vllm serve`` starts on vLLM's CPU build (docs/patches.md).
Goes when: a release reads its own distribution name.
"""

from __future__ import annotations

import ast
from typing import Any

from ... import checks
from ...shapes import Probe, top_level
from .._probe import finds, fingerprints, probes
from .._wrap import Replacement, wrap
from ..hooks import Hooks

PATCH_ID = "cpu-dist-name"
FUNCTION = "main"
SHAPE = "version-of-vllm"


# The fix is the metadata finder ``vllm_hsfix_dist.pth`` installs at interpreter start;
# wrapping ``main`` installs it where the ``.pth`` was not read (``vllm-hsfix run``).
def _finder() -> Any:
    import _vllm_hsfix_dist

    return _vllm_hsfix_dist


def with_distribution_name(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """The installed ``main``: the finder in place (idempotent), then vLLM's own."""
    _finder().install()
    return wrapped(*args, **kwargs)


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    _finder().install()
    return [wrap(module, FUNCTION, with_distribution_name, PATCH_ID)]


# The gate for code of no tested build: ``main()`` calls ``version("vllm")`` (0.17.0-
# every release read); a ``main`` that no longer does is "fixed"; no ``main`` at all is unknown.
def shape_check(tree: ast.Module) -> Probe:
    fn = top_level(tree, FUNCTION)
    if not isinstance(fn, ast.FunctionDef):
        return Probe(None, detail=f"expected but not found: a function {FUNCTION}")
    if finds(fn, "version('vllm')") or finds(fn, "_.version('vllm')"):
        return Probe(SHAPE, detail='main() reads version("vllm")')
    return Probe(None, fixed=True, detail='main() no longer reads version("vllm")')


probe_tree, probe = probes(
    PATCH_ID, lambda tree: fingerprints(tree, (FUNCTION,)), shape_check, (FUNCTION,)
)


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
