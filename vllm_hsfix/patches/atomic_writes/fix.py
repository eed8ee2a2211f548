"""``atomic-writes``: a hidden-states file appears at its path whole, or not at all
(docs/patches.md). Goes when: every supported release writes atomically.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import textwrap
from typing import Any

from ... import checks
from ...shapes import Probe
from .._connector_io import check_writer, fsync, temp_path
from .._probe import calls, definition, expect, finds, fingerprints, params, probes
from .._wrap import Replacement, arg, original_of, subclasses, wrap
from ..hooks import Hooks

PATCH_ID = "atomic-writes"
ATTRIBUTE = "ExampleHiddenStatesConnector"
WRITER = "_write_tensors"
PARAMS = ("tensors", "event", "filename", "lock_fd")
SHAPE = "write-in-place"
HOOK = "__init_subclass__"


def write_atomically(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The fix: the release's writer writes a hidden temporary file in the same directory,
    with no lock; then fsync, rename onto the final path (atomic within a file system),
    fsync the directory, and only then release the lock. The .lock protocol is kept."""
    tensors, event, filename, lock_fd = (arg(args, kwargs, i, p) for i, p in enumerate(PARAMS))
    tmp = temp_path(filename)
    try:
        wrapped(tensors, event, tmp, None)
        fsync(tmp)
        os.replace(tmp, filename)
        # The rename itself on disk; some file systems cannot fsync a directory.
        with contextlib.suppress(OSError):
            fsync(os.path.dirname(filename) or ".", directory=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX, as the release does


# Subclasses that override the writer: qualified name -> "covered" or why not.
SUBCLASSES: dict[str, str] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    """The release's writer, and every subclass's own writer of its shape, defined now
    or later (through ``__init_subclass__``: hs-connectors' class comes after the patch);
    another shape is left alone and named in ``SUBCLASSES`` (``verify`` reports it)."""
    base = getattr(module, ATTRIBUTE)
    main = wrap(base, WRITER, write_atomically, PATCH_ID)

    def subclass_writer(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        if not main.wrapper.hsfix_active:  # the patch was reverted: pass through
            return wrapped(*args, **kwargs)
        return write_atomically(wrapped, instance, args, kwargs)

    def cover(cls: type) -> None:
        if WRITER not in cls.__dict__:
            return  # inherits the release's writer: already covered
        problem = subclass_writer_problem(cls)
        if problem is None:
            wrap(cls, WRITER, subclass_writer, PATCH_ID)
        SUBCLASSES[_qualname(cls)] = "covered" if problem is None else f"not covered: {problem}"

    def on_subclass(wrapped: Any, cls: Any, args: Any, kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if main.wrapper.hsfix_active and isinstance(cls, type):
            try:
                cover(cls)
            except Exception as exc:  # never break the definition of someone's class
                SUBCLASSES[_qualname(cls)] = f"not covered: {exc!r}"
                hooks.on_failure(PATCH_ID, exc)
        return result

    for sub in subclasses(base):
        cover(sub)
    if HOOK not in base.__dict__:
        # A classmethod of its own to wrap, doing what the inherited one does.
        setattr(base, HOOK, classmethod(lambda cls, **kw: super(base, cls).__init_subclass__(**kw)))
    return [main, wrap(base, HOOK, on_subclass, PATCH_ID)]


def writer_shape(fn: ast.AST | None) -> Probe:
    """The gate, for a writer of no tested build and for a subclass's own writer."""
    called = calls(fn)
    if {"os.replace", "os.rename"} & set(called):
        return Probe(None, fixed=True, detail=f"{WRITER} renames into place")
    body = fn.body if isinstance(fn, ast.FunctionDef) else []
    tries = [n for n in body if isinstance(n, ast.Try)]
    opens = {"open", "os.open", "os.write", "torch.save", "shutil.copy", "shutil.move"}
    return expect(
        SHAPE,
        f"{WRITER} writes the final path in place",
        {
            f"a staticmethod {WRITER}{PARAMS}": isinstance(fn, ast.FunctionDef)
            and [ast.unparse(d) for d in fn.decorator_list] == ["staticmethod"]
            and params(fn) == PARAMS,
            "one save_file(..., filename)": called.count("save_file") == 1
            and finds(fn, "save_file(_, filename)"),
            "save_file inside a try whose finally closes lock_fd": bool(tries)
            and any(finds(s, "save_file(_, filename)") for s in tries[-1].body)
            and any(finds(s, "os.close(lock_fd)") for s in tries[-1].finalbody),
            "nothing else opens, writes or moves files": not opens & set(called),
        },
    )


def shape_check(tree: ast.Module) -> Probe:
    return writer_shape(definition(tree, f"{ATTRIBUTE}.{WRITER}"))


probe_tree, probe = probes(
    PATCH_ID,
    lambda tree: fingerprints(tree, (WRITER,), ATTRIBUTE),
    shape_check,
    (f"{ATTRIBUTE}.{WRITER}",),
)


def subclass_writer_problem(cls: type) -> str | None:
    """Why ``cls``'s own writer is not of the release's shape (None when it is)."""
    raw = original_of(cls.__dict__.get(WRITER))
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(getattr(raw, "__func__", raw)))).body[0]
    except (OSError, TypeError, SyntaxError) as exc:
        return f"its source cannot be read ({exc!r})"
    got = writer_shape(fn)
    return None if got.shape == SHAPE and isinstance(raw, staticmethod) else got.detail or "fixed"


def knownsubclasses() -> list[type]:
    """The connector subclasses users run, where installed: hs-connectors' fp8 backend."""
    try:
        module = importlib.import_module("hs_connectors.fp8_hidden_states_connector")
    except (ImportError, ValueError):
        return []
    return [module.FP8HiddenStatesConnector]


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live writer replaces the final path with a complete file, then unlocks; so
    does every installed subclass's own writer, or the check names it as not covered."""
    base = getattr(module, ATTRIBUTE)
    name = f"{ATTRIBUTE}.{WRITER} renames a complete file into place, then releases the lock"
    out = checks.one(name, lambda: check_writer(base))
    for sub in dict.fromkeys([*knownsubclasses(), *subclasses(base)]):
        label = f"{_qualname(sub)}.{WRITER} (a subclass's own writer) renames into place"
        state = SUBCLASSES.get(_qualname(sub), f"not covered: {PATCH_ID} not applied here")
        if WRITER not in sub.__dict__:
            continue
        if state != "covered":
            out.append(checks.result(label, [state]))
        else:
            out += checks.one(label, lambda sub=sub: check_writer(sub, same_tensors=False))
    return out
