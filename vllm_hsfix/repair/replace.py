"""Putting a regenerated file in place of the old one, atomically, keeping its form.

The new file (written by vLLM's own connector into a scratch directory) must hold the
target's token ids, the same tensor names, the same ``hidden_states`` dtype and the
same ``[n_aux, hidden]`` as the old one wherever the old header said (an fp8 file: its
scales too); otherwise it is
refused and the old file stays. Accepted: copied to a temporary file in the target's
directory, fsynced, the old file copied under ``--backup`` if asked, then renamed over
the old one (``os.replace``: a reader sees the old file or the new, never a mix), and
the directory fsynced so the rename survives a crash.
"""

from __future__ import annotations

import hashlib
import os
import shutil

from ..audit import format as fmt
from .targets import Target


class Refused(Exception):
    """The regenerated file does not fit the target; the old file is left alone."""


def check_new(new: str, target: Target) -> None:
    """Raise :class:`Refused` unless ``new`` fits ``target`` (see the module docstring)."""
    try:
        _, _, data_start, tensors, layout = fmt.read_layout(new)
    except (fmt.BadFile, OSError) as exc:
        raise Refused(f"the regenerated file is unreadable: {exc}") from exc
    if layout is not None:
        raise Refused(f"the regenerated file is {layout.code}: {layout.detail}")
    keys = {fmt.HIDDEN_KEY, fmt.TOKEN_KEY} | ({fmt.SCALES_KEY} if target.fp8 else set())
    if set(tensors) != keys:
        raise Refused(f"the regenerated file holds {sorted(tensors)}")
    hs, ti = tensors[fmt.HIDDEN_KEY], tensors[fmt.TOKEN_KEY]
    if target.dtype and hs["dtype"] != target.dtype:
        raise Refused(
            f"vLLM wrote {hs['dtype']} hidden states, the file had {target.dtype} "
            "(run vLLM with the dtype the dataset was made with)"
        )
    shape = hs["shape"]
    if len(shape) != 3 or shape[0] != target.tokens:
        raise Refused(f"hidden_states {shape} for {target.tokens} tokens")
    if target.n_aux is not None and [target.n_aux, target.hidden] != list(shape[1:]):
        raise Refused(
            f"[n_aux, hidden] = {list(shape[1:])}, the file had [{target.n_aux}, {target.hidden}]"
        )
    ids = fmt.read_token_ids(new, data_start + ti["data_offsets"][0], ti["shape"][0])
    if ids.tolist() != target.token_ids:
        raise Refused("the regenerated file holds other token ids")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(new: str, target: Target, backup: str | None, root: str | None) -> tuple[str, int]:
    """Replace ``target.path`` by ``new`` (checked first); returns (sha256, size) of the
    file now in place. ``backup``: keep the old file at ``backup/<path under root>``."""
    check_new(new, target)
    directory = os.path.dirname(os.path.abspath(target.path))
    tmp = os.path.join(directory, f".{os.path.basename(target.path)}.repair-{os.getpid()}")
    try:
        digest, size = _copy_synced(new, tmp)
        if backup and os.path.exists(target.path):
            rel = os.path.relpath(os.path.abspath(target.path), root or directory)
            if rel.startswith(".."):
                rel = os.path.basename(target.path)
            dest = os.path.join(backup, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(target.path, dest)
        os.replace(tmp, target.path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return digest, size


def _copy_synced(src: str, dst: str) -> tuple[str, int]:
    """Copy ``src`` to a new ``dst`` and fsync it; the copy's sha256 (for the journal)
    and size, taken from the bytes as they are written instead of reading them back."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as fout:
        while n := fin.readinto(buf):
            h.update(view[:n])
            fout.write(view[:n])
            size += n
        os.fsync(fout.fileno())
    return h.hexdigest(), size
