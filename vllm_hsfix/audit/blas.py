"""One BLAS thread while an audit worker judges its files.

The prefix sketches are small matrix products (:func:`.prefix.sketch_rows`). One 2-D
product per file is the fastest way to compute them (measured: 3-4x fewer seconds than
one product per token), but a product that large makes OpenBLAS start its threads,
which spin: two workers on two cores then ran 10x slower. Inside :func:`single_thread`
the worker's OpenBLAS (numpy's own copy, found among the libraries the process has
loaded) runs on one thread, and the products are made whole; where its thread count
cannot be set (another BLAS, no ``/proc``), :func:`on` stays False and the sketches
are made one small product per token, as before. The count is put back afterwards:
a Ray worker process runs other tasks too.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

# (get, set) symbol pairs, numpy's bundled scipy-openblas first.
_SYMBOLS = (
    ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
    ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
    ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
    ("openblas_get_num_threads", "openblas_set_num_threads"),
)
_on = False


@lru_cache(maxsize=1)
def _openblas() -> tuple[Any, Any] | None:
    """The (get, set) thread-count functions of the OpenBLAS numpy loaded, or None."""
    import numpy  # noqa: F401  (its BLAS must be loaded to be found)

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            get, put = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and put is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


def on() -> bool:
    """Whether BLAS runs on one thread here now (inside :func:`single_thread`)."""
    return _on


@contextlib.contextmanager
def single_thread() -> Iterator[bool]:
    """One BLAS thread inside; yields whether that could be arranged."""
    global _on
    fns = _openblas()
    if fns is None or _on:
        yield _on
        return
    get, put = fns
    before = get()
    put(1)
    _on = True
    try:
        yield True
    finally:
        _on = False
        put(before)
