"""``atomic-writes``: a hidden-states file appears at its path whole, or not at all.

Target: ``ExampleHiddenStatesConnector._write_tensors``, vLLM 0.22.0-0.33.x (any
platform), and every subclass's own writer of the same shape (hs-connectors' fp8).
Why: the writer thread calls ``save_file`` on the final path, then closes the ``.lock``
descriptor; a worker killed mid-write (or a full disk) leaves a truncated file there,
which a reader waiting on the lock then reads. Upstream: none (beyond upstream, on by
default, opt out with ``VLLM_HSFIX_DISABLED_PATCHES=atomic-writes``; safetensors >=
0.8.0 renames into place itself). Goes when: every supported release writes atomically.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import inspect
import os
import secrets
import tempfile
import textwrap
import threading
from typing import Any

from .. import checks
from ..shapes import Probe, method, top_level
from ._probe import calls, expect, finds, fingerprints, gate, params, probe_live
from ._wrap import Replacement, original_of, wrap
from .hooks import Hooks

PATCH_ID = "atomic-writes"
ATTRIBUTE = "ExampleHiddenStatesConnector"
WRITER = "_write_tensors"
PARAMS = ("tensors", "event", "filename", "lock_fd")
SHAPE = "write-in-place"
TMP_SUFFIX = ".hsfix-tmp"
HOOK = "__init_subclass__"


# The fix: the release's own writer writes a temporary file in the same directory
# (hidden, not a .safetensors name) and is handed no lock; the wrapper then fsyncs it,
# renames it onto the final path (atomic within a file system), fsyncs the directory,
# and only then closes the lock descriptor. Readers' .lock protocol is unchanged.
def temp_path(filename: str) -> str:
    """A fresh name next to ``filename`` (same directory, so the rename is atomic)."""
    head, tail = os.path.split(filename)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(PARAMS, args, strict=False))
    bound.update(kwargs)
    missing = [p for p in PARAMS if p not in bound]
    if missing:
        raise TypeError(f"{WRITER}() missing {missing}")
    return bound


def write_atomically(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The installed ``_write_tensors``: the release's write to a temporary file, then
    fsync, rename onto the final path, and only then release the lock."""
    a = _arguments(args, kwargs)
    filename, lock_fd = a["filename"], a["lock_fd"]
    tmp = temp_path(filename)
    try:
        wrapped(a["tensors"], a["event"], tmp, None)
        _fsync(tmp)
        os.replace(tmp, filename)
        # The rename itself on disk; some file systems cannot fsync a directory.
        with contextlib.suppress(OSError):
            _fsync(os.path.dirname(filename) or ".", directory=True)
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


def _subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        out.append(sub)
        todo.extend(sub.__subclasses__())
    return out


def apply(module: object, shape: str, hooks: Hooks) -> list[Replacement]:
    """The release's writer, plus every subclass's own writer: those defined already
    and, through ``__init_subclass__`` on the connector, those defined later (hs-connectors
    imports vLLM's connector module first, so its class comes after the patch). A
    subclass writer of another shape is left alone and named in ``SUBCLASSES`` (``verify``
    reports it)."""
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

    for sub in _subclasses(base):
        cover(sub)
    if HOOK not in base.__dict__:
        # A classmethod of its own to wrap, doing what the inherited one does.
        setattr(base, HOOK, classmethod(lambda cls, **kw: super(base, cls).__init_subclass__(**kw)))
    return [main, wrap(base, HOOK, on_subclass, PATCH_ID)]


# The gate, for the release's writer of no tested build and for a subclass's own writer:
# a static _write_tensors(tensors, event, filename, lock_fd) calling save_file(tensors,
# filename) once inside a try whose finally closes lock_fd, opening no other file. A
# writer that renames or replaces is "fixed".
def writer_shape(fn: ast.AST | None) -> Probe:
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


def probe_tree(tree: ast.Module) -> Probe:
    fps = fingerprints(tree, (WRITER,), ATTRIBUTE)
    cls = top_level(tree, ATTRIBUTE)
    fn = method(cls, WRITER) if isinstance(cls, ast.ClassDef) else None
    return gate(PATCH_ID, fps, lambda: writer_shape(fn))


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, (f"{ATTRIBUTE}.{WRITER}",))


def subclass_writer_problem(cls: type) -> str | None:
    """Why ``cls``'s own writer is not of the release's shape (None when it is)."""
    raw = original_of(cls.__dict__.get(WRITER))
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(raw.__func__))).body[0]
    except (AttributeError, OSError, TypeError, SyntaxError) as exc:
        return f"its source cannot be read ({exc!r})"
    got = writer_shape(fn)
    return None if got.shape == SHAPE and isinstance(raw, staticmethod) else got.detail or "fixed"


class _Done:
    """A copy event that is already complete (what the writer waits on first)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def check_writer(cls: type, same_tensors: bool = True) -> list[str]:
    """Call the LIVE ``cls._write_tensors`` as the connector does and list what is wrong.

    The final path starts as a hard link of a "witness" file holding old bytes: a
    writer that writes the final path in place changes the witness too (same inode); a
    writer that renames a new file onto the path leaves it alone. A reader thread
    blocked on the ``.lock`` must find the new, complete file the moment it gets the
    lock (so the writer released it, after the file was in place). Afterwards no
    temporary file is left. ``same_tensors=False`` for a subclass whose writer
    transforms what it writes (fp8): then the token ids must come back unchanged."""
    import torch
    from safetensors.torch import load_file

    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-check-") as d:
        final = os.path.join(d, "req-0.safetensors")
        witness = os.path.join(d, "witness")
        with open(witness, "wb") as fh:
            fh.write(b"old bytes")
        os.link(witness, final)
        lock_fd = os.open(final + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        seen: dict[str, Any] = {}

        def reader() -> None:
            with open(final + ".lock") as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
                try:
                    seen["data"] = load_file(final)
                except Exception as exc:
                    seen["error"] = repr(exc)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        tensors = {
            "hidden_states": torch.arange(24, dtype=torch.float32).reshape(4, 2, 3),
            "token_ids": torch.arange(4),
        }
        cls._write_tensors(tensors, _Done(), final, lock_fd)
        t.join(timeout=30)
        with open(witness, "rb") as fh:
            if fh.read() != b"old bytes":
                problems.append(
                    "the file was written in place at its final path (a killed writer leaves "
                    "a truncated file there)"
                )
        if "error" in seen or "data" not in seen:
            problems.append(
                f"a reader holding the lock did not find the complete file: {seen.get('error')}"
            )
        elif not torch.equal(seen["data"].get("token_ids", torch.empty(0)), tensors["token_ids"]):
            problems.append("the reader read other token ids than were written")
        elif same_tensors and not all(torch.equal(seen["data"][k], v) for k, v in tensors.items()):
            problems.append("the reader read other data than was written")
        leftovers = [n for n in os.listdir(d) if n.endswith(TMP_SUFFIX)]
        if leftovers:
            problems.append(f"temporary files left behind: {leftovers}")
    return problems


def known_subclasses() -> list[type]:
    """The connector subclasses users run, imported when installed: hs-connectors' fp8
    backend (its ``file`` backend is vLLM's own class; ``mooncake`` has a connector of
    its own, not a subclass)."""
    import importlib
    import importlib.util

    out = []
    with contextlib.suppress(ImportError, ValueError):
        if importlib.util.find_spec("hs_connectors") is not None:
            mod = importlib.import_module("hs_connectors.fp8_hidden_states_connector")
            out.append(mod.FP8HiddenStatesConnector)
    return out


def verify(module: Any, ctx: checks.Context) -> list[dict[str, Any]]:
    """The live writer replaces the final path with a complete file, then unlocks; so
    does every installed subclass's own writer, or the check names it as not covered."""
    base = getattr(module, ATTRIBUTE)
    name = f"{ATTRIBUTE}.{WRITER} renames a complete file into place, then releases the lock"
    out = checks.one(name, lambda: check_writer(base))
    known = known_subclasses()
    for sub in dict.fromkeys([*known, *_subclasses(base)]):
        if WRITER not in sub.__dict__:
            continue
        label = f"{_qualname(sub)}.{WRITER} (a subclass's own writer) renames into place"
        state = SUBCLASSES.get(
            _qualname(sub), "not covered: atomic-writes was not applied in this process"
        )
        if state != "covered":
            out.append({"check": label, "ok": False, "problems": [state]})
        else:
            out += checks.one(label, lambda sub=sub: check_writer(sub, same_tensors=False))
    return out
