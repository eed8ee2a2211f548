"""Read a few files out of a wheel on PyPI without downloading it (stdlib only).

Why: the CUDA ``vllm`` wheels are 250-430 MB each, and what the static tests and
``scripts/fingerprints.py`` need from them is a dozen small files (the dist-info, the
version and platform files and the three patch targets). A wheel is a zip file: its
central directory sits at the end and names every member's offset, so HTTP range
requests for the end of the file, the directory, and then each wanted member read
exactly those bytes (a few hundred KB per wheel instead of hundreds of MB).

Where the files come from: PyPI's simple index in its JSON form (PEP 691, the API pip
itself uses) gives every file of a project with its URL on files.pythonhosted.org, its
size and its sha256. :func:`pick_wheel` chooses the wheel pip installs on x86-64 Linux
(for a version with rebuilt wheels, the highest build tag). The whole-file sha256
cannot be checked without the whole file, so every member read is checked against the
wheel's own ``RECORD`` (sha256 and size per file) instead; a mismatch raises.

``VLLM_HSFIX_INDEX`` overrides the index (default ``https://pypi.org/simple``).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

INDEX = os.environ.get("VLLM_HSFIX_INDEX", "https://pypi.org/simple").rstrip("/")
# Reads are rounded out to blocks of this size, so the local header and the data of a
# small member come in one request.
BLOCK = 64 * 1024
RETRIES = 4


class RemoteError(RuntimeError):
    """The index or a wheel could not be read, or a member failed its RECORD check."""


@dataclass(frozen=True)
class RemoteWheel:
    """One wheel file on the index."""

    filename: str
    url: str
    size: int
    sha256: str
    build: int  # the wheel's build tag (0 when it has none)


@dataclass
class Traffic:
    """What reading cost: HTTP requests made and bytes received."""

    requests: int = 0
    received: int = 0
    seconds: float = 0.0
    wheels: list[str] = field(default_factory=list)

    def add(self, other: Traffic) -> None:
        self.requests += other.requests
        self.received += other.received
        self.seconds += other.seconds
        self.wheels += other.wheels

    def __str__(self) -> str:
        return (
            f"{self.requests} requests, {self.received / 1e6:.2f} MB received "
            f"in {self.seconds:.1f} s"
        )


def _get(url: str, headers: dict[str, str], traffic: Traffic) -> bytes:
    """One GET with retries (transient network errors only)."""
    delay = 1.0
    for attempt in range(RETRIES):
        t0 = time.monotonic()
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "vllm-hsfix-tests", **headers})
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = resp.read()
                if "Range" in headers and resp.status != 206:
                    raise RemoteError(f"{url}: server ignored the range request ({resp.status})")
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if isinstance(exc, urllib.error.HTTPError) and exc.code < 500:
                raise RemoteError(f"GET {url}: HTTP {exc.code}") from exc
            if attempt == RETRIES - 1:
                raise RemoteError(f"GET {url}: {exc}") from exc
            time.sleep(delay)
            delay *= 2
            continue
        finally:
            traffic.seconds += time.monotonic() - t0
        traffic.requests += 1
        traffic.received += len(data)
        return data
    raise AssertionError("unreachable")


def index_files(project: str, traffic: Traffic | None = None) -> list[dict[str, Any]]:
    """Every file the index lists for ``project`` (PEP 691 JSON)."""
    data = _get(
        f"{INDEX}/{project}/",
        {"Accept": "application/vnd.pypi.simple.v1+json"},
        traffic if traffic is not None else Traffic(),
    )
    return list(json.loads(data)["files"])


_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d+)[^-]*)?"
    r"-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$"
)


def pick_wheel(
    files: list[dict[str, Any]], project: str, version: str, arch: str = "x86_64"
) -> RemoteWheel:
    """The wheel pip installs for ``project==version`` on Linux ``arch``: a not-yanked
    ``manylinux`` wheel of that exact version, the highest build tag winning (PyPI holds
    rebuilt vLLM wheels with tags ``-1`` / ``-2`` beside the untagged originals)."""
    dist = project.replace("-", "_").lower()
    found: list[RemoteWheel] = []
    for f in files:
        m = _WHEEL.match(str(f["filename"]))
        if not m or m["name"].lower() != dist or m["version"] != version:
            continue
        if f.get("yanked") or not m["plat"].startswith("manylinux") or arch not in m["plat"]:
            continue
        found.append(
            RemoteWheel(
                filename=str(f["filename"]),
                url=str(f["url"]),
                size=int(f["size"]),
                sha256=str((f.get("hashes") or {}).get("sha256", "")),
                build=int(m["build"] or 0),
            )
        )
    if not found:
        raise RemoteError(f"no {arch} manylinux wheel of {project}=={version} on {INDEX}")
    return max(found, key=lambda w: (w.build, w.filename))


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file, fetched in cached blocks by HTTP
    range requests (enough for :class:`zipfile.ZipFile`)."""

    def __init__(self, url: str, size: int, traffic: Traffic) -> None:
        super().__init__()
        self.url, self.size, self.traffic = url, size, traffic
        self.pos = 0
        self.blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _fetch(self, first: int, last: int) -> None:
        """Blocks ``first..last`` (inclusive) that are not cached yet, in one request."""
        missing = [b for b in range(first, last + 1) if b not in self.blocks]
        if not missing:
            return
        start = missing[0] * BLOCK
        end = min(self.size, (missing[-1] + 1) * BLOCK) - 1
        data = _get(self.url, {"Range": f"bytes={start}-{end}"}, self.traffic)
        if len(data) != end - start + 1:
            raise RemoteError(f"{self.url}: asked for {end - start + 1} bytes, got {len(data)}")
        for b in range(missing[0], missing[-1] + 1):
            self.blocks[b] = data[(b - missing[0]) * BLOCK : (b - missing[0] + 1) * BLOCK]

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.size:
            return b""
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        self._fetch(self.pos // BLOCK, (end - 1) // BLOCK)
        out = bytearray()
        pos = self.pos
        while pos < end:
            block = self.blocks[pos // BLOCK]
            off = pos % BLOCK
            piece = block[off : off + (end - pos)]
            out += piece
            pos += len(piece)
        self.pos = end
        return bytes(out)

    def readinto(self, buf: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def _record(zf: zipfile.ZipFile) -> dict[str, tuple[str, int]]:
    """``RECORD``: path -> (sha256 hex, size) for every hashed member."""
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
    out: dict[str, tuple[str, int]] = {}
    for row in csv.reader(io.StringIO(zf.read(name).decode())):
        if len(row) >= 3 and row[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(row[1][len("sha256=") :] + "==").hex()
            out[row[0]] = (digest, int(row[2]))
    return out


def read_members(
    wheel: RemoteWheel, wanted: Callable[[str], bool], traffic: Traffic | None = None
) -> dict[str, bytes]:
    """The members of ``wheel`` that ``wanted`` accepts, each checked against the
    wheel's ``RECORD`` (the RECORD file itself carries no hash of its own)."""
    traffic = traffic if traffic is not None else Traffic()
    traffic.wheels.append(wheel.filename)
    with zipfile.ZipFile(RangeFile(wheel.url, wheel.size, traffic)) as zf:
        record = _record(zf)
        out: dict[str, bytes] = {}
        for name in zf.namelist():
            if not wanted(name):
                continue
            data = zf.read(name)
            if not name.endswith(".dist-info/RECORD"):
                want = record.get(name)
                got = (hashlib.sha256(data).hexdigest(), len(data))
                if want != got:
                    raise RemoteError(f"{wheel.filename}: {name} does not match RECORD")
            out[name] = data
    return out
