"""``atomic-writes``: a hidden-states file appears at its path whole, or not at all.

From vLLM 0.22.0 the connector's writer thread (``_write_tensors``) calls
``save_file(tensors, filename)`` on the final path and then closes the ``.lock`` file's
descriptor, which releases the exclusive lock readers wait on. A worker killed during
the write (OOM killer, SIGKILL, a lost node) or a full disk leaves a truncated file at
the final path; the kernel releases the dead writer's lock, so a reader waiting on it
reads the truncated file (safetensors refuses it), and a job that checks only for the
file's existence counts the request as done. No release up to 0.33.0 changes this
(``_write_tensors`` reads the same in 0.22.0-0.33.0) and upstream has no fix or issue.

Beyond upstream, and on by default (``VLLM_HSFIX_DISABLED_PATCHES=atomic-writes``
turns it off): the release's own ``_write_tensors`` writes to a temporary file in the
same directory (``.<name>.<pid>.<random>.hsfix-tmp``: hidden, and not a
``.safetensors`` name, so nothing that scans for those sees it) and is handed no lock
descriptor; the wrapper then flushes the file to disk (``fsync``), renames it onto the
final path (``os.replace``, atomic within a file system), flushes the directory, and
only then closes the lock descriptor. Readers' ``.lock`` protocol is unchanged, and a
reader that gets the lock finds the complete file in place. On an error the temporary
file is removed and the error goes where the release sends it; a killed writer leaves
only its temporary file behind.

Why wrap ``_write_tensors`` and not ``save_file``: it is the one place every release of
the range writes through (``wait_for_save`` in 0.22-0.23, ``_submit_async_write`` from
0.24, and ``cpu-connector-save`` on vLLM's CPU build all hand it the file and the lock
descriptor), and the release's own body still waits for its copy event and writes.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import os
import secrets
import tempfile
import threading
from typing import Any

from .. import checks
from ..shapes import Probe, fingerprint, method, top_level
from ._probe import probe_live
from ._wrap import Replacement, original_of, wrap
from .hooks import Hooks

PATCH_ID = "atomic-writes"
ATTRIBUTE = "ExampleHiddenStatesConnector"
WRITER = "_write_tensors"
PARAMS = ("tensors", "event", "filename", "lock_fd")
SHAPE = "write-in-place"
TMP_SUFFIX = ".hsfix-tmp"
HOOK = "__init_subclass__"


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


# Subclasses that override the writer (hs-connectors' FP8HiddenStatesConnector quantizes
# in its own ``_write_tensors``): qualified name -> "covered" or why not.
SUBCLASSES: dict[str, str] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def subclass_writer_problem(cls: type) -> str | None:
    """Why ``cls``'s own writer cannot be made atomic the way the release's is (None
    when it can): it must be a static ``_write_tensors(tensors, event, filename,
    lock_fd)`` that writes ``filename`` with one ``save_file(..., filename)``, closes
    ``lock_fd`` in a ``finally`` and opens no other file; the wrapper then hands it a
    temporary name and no lock, as it does the release's."""
    import inspect
    import textwrap

    raw = original_of(cls.__dict__.get(WRITER))
    if not isinstance(raw, staticmethod):
        return f"{WRITER} is not a staticmethod"
    fn = raw.__func__
    if tuple(inspect.signature(fn).parameters) != PARAMS:
        return f"{WRITER}{tuple(inspect.signature(fn).parameters)}, expected {PARAMS}"
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as exc:
        return f"its source cannot be read ({exc})"
    names = {_call_name(c) for c in _calls(tree)}
    saves = [c for c in _calls(tree) if _call_name(c) == "save_file"]
    if (
        len(saves) != 1
        or len(saves[0].args) != 2
        or getattr(saves[0].args[1], "id", "") != "filename"
    ):
        return "it does not write with exactly one save_file(..., filename)"
    if names & {
        "open",
        "os.open",
        "os.write",
        "torch.save",
        "shutil.copy",
        "os.replace",
        "os.rename",
    }:
        return "it opens, writes or renames files itself"
    fn_node = tree.body[0]
    tries = [n for n in getattr(fn_node, "body", []) if isinstance(n, ast.Try)]
    if not tries or not any(
        _call_name(c) == "os.close" and _args_are(c, ("lock_fd",))
        for stmt in tries[-1].finalbody
        for c in _calls(stmt)
    ):
        return "it does not release lock_fd in a finally after the write"
    return None


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


# ---------------------------------------------------------------------------
# The shape gate


def _calls(fn: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call)]


def _call_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return f"{f.value.id}.{f.attr}"
    return ""


def _args_are(call: ast.Call, names: tuple[str, ...]) -> bool:
    return not call.keywords and [getattr(a, "id", None) for a in call.args] == list(names)


def probe_tree(tree: ast.Module) -> Probe:
    """Known shape ``write-in-place`` (0.22.0-0.33.0): a static ``_write_tensors(tensors,
    event, filename, lock_fd)`` that calls ``save_file(tensors, filename)`` once and
    closes ``lock_fd`` in a ``finally``, after the write. A writer that renames or
    replaces is "fixed"; anything else is unknown."""
    cls = top_level(tree, ATTRIBUTE)
    if not isinstance(cls, ast.ClassDef):
        return Probe(None, detail=f"no class {ATTRIBUTE} in the module")
    fn = method(cls, WRITER)
    fps = {WRITER: fingerprint(fn)}
    if fn is None:
        return Probe(None, detail=f"{ATTRIBUTE} has no {WRITER}", fingerprints=fps)
    names = {_call_name(c) for c in _calls(fn)}
    if names & {"os.replace", "os.rename", "shutil.move"}:
        return Probe(None, fixed=True, detail=f"{WRITER} renames into place", fingerprints=fps)
    saves = [c for c in _calls(fn) if _call_name(c) == "save_file"]
    tries = [n for n in fn.body if isinstance(n, ast.Try)]
    closes_last = bool(tries) and any(
        _call_name(c) == "os.close" and _args_are(c, ("lock_fd",))
        for stmt in tries[-1].finalbody
        for c in _calls(stmt)
    )
    saves_in_try = bool(tries) and any(c in saves for stmt in tries[-1].body for c in _calls(stmt))
    expected = {
        f"{WRITER} is a staticmethod": any(
            getattr(d, "id", None) == "staticmethod" for d in fn.decorator_list
        ),
        f"{WRITER}{PARAMS}": tuple(a.arg for a in fn.args.args) == PARAMS,
        "one save_file(tensors, filename)": len(saves) == 1
        and _args_are(saves[0], ("tensors", "filename")),
        "save_file inside a try whose finally closes lock_fd": saves_in_try and closes_last,
        "nothing else opens or writes files": not (
            names & {"open", "os.open", "os.write", "torch.save", "shutil.copy"}
        ),
    }
    missing = [k for k, ok in expected.items() if not ok]
    if missing:
        return Probe(None, detail="expected but not found: " + "; ".join(missing), fingerprints=fps)
    return Probe(SHAPE, detail=f"{WRITER} writes the final path in place", fingerprints=fps)


def live_objects(module: object) -> dict[str, object]:
    cls = getattr(module, ATTRIBUTE, None)
    return {f"{ATTRIBUTE}.{WRITER}": cls.__dict__.get(WRITER) if isinstance(cls, type) else None}


def probe(module: object) -> Probe:
    return probe_live(module, probe_tree, live_objects)


# ---------------------------------------------------------------------------
# The check on the live class


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
