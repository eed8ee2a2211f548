"""``vllm-hsfix audit --ray`` on a real local Ray cluster of two nodes (a head and a
worker node, one CPU each, ``ray.cluster_utils.Cluster``: separate raylets, object
stores and worker processes, as on two machines sharing a filesystem).

Run by the ``ray`` row of ``scripts/run_tests.py`` (its venv: Ray, numpy, tqdm,
pytest; no torch, no vLLM); elsewhere Ray is not installed and these skip (marker
``ray``, left out of the other rows). The expected verdicts come from how the files
were damaged and from the local run, never from the Ray run itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.npfiles import causal_dataset

ray = pytest.importorskip("ray", reason="Ray is not installed (the ray row of run_tests.py)")

from vllm_hsfix.audit import pipeline  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c.address
    finally:
        c.shutdown()


def cli(*args: str, **kw: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_hsfix", "audit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
        **kw,  # type: ignore[arg-type]
    )


def records(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]


def final_verdicts(recs: list[dict]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in recs:
        if r["type"] in ("file", "update"):
            out[r["path"]] = r["verdict"]
    return out


def test_ray_gives_the_local_verdicts(tmp_path: Path, cluster: str) -> None:
    paths = causal_dataset(tmp_path / "d", 60, wrong=frozenset({5, 33}), zero=frozenset({12}))
    local = pipeline.audit_paths([tmp_path / "d"], workers=2)
    proc = cli(str(tmp_path / "d"), "--ray", cluster, "--jsonl", "-")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err  # corrupt files: exit 1 like the local run
    recs = records(out)
    got = final_verdicts(recs)
    assert got == dict(local.verdicts)
    assert got[str(paths[5])] == got[str(paths[33])] == got[str(paths[12])] == "corrupt"
    assert sum(v == "ok" for v in got.values()) == 57
    summary = recs[-1]
    assert summary["type"] == "summary" and summary["totals"]["backend"] == "ray"
    assert summary["totals"]["workers"] == 2  # both nodes' CPUs
    assert sum(r["type"] == "file" for r in recs) == 60


def _stalled_ray_worker(timeout: float) -> int:
    """The pid of a Ray task process blocked opening the FIFO (``wait_for_partner``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                wchan = Path(f"/proc/{entry}/wchan").read_text()
            except OSError:
                continue
            if cmd.startswith(b"ray::run_batch") and ("partner" in wchan or "fifo" in wchan):
                return int(entry)
        time.sleep(0.1)
    raise AssertionError("no Ray task blocked on the FIFO")


def test_a_worker_killed_mid_scan_loses_nothing_and_counts_nothing_twice(
    tmp_path: Path, cluster: str
) -> None:
    """A FIFO among the files holds its task in ``open()`` until we write to it: the
    test kills that task's worker process (SIGKILL) mid-batch, Ray re-runs the batch,
    then the FIFO is fed. Every file must come back exactly once, with the local
    verdicts; the files the killed worker had already judged are judged again, once."""
    root = tmp_path / "d"
    causal_dataset(root, 40, wrong=frozenset({3}))
    local = dict(pipeline.audit_paths([root], workers=2).verdicts)
    fifo = root / "f0015x.safetensors"  # mid-batch, after f0015 in sorted order
    os.mkfifo(fifo)
    proc = cli(str(root), "--ray", cluster, "--jsonl", "-", "--no-progress")
    try:
        victim = _stalled_ray_worker(120)
        os.kill(victim, signal.SIGKILL)

        # Feed the FIFO to whichever attempt opens it next (the retry).
        def feed() -> None:
            fd = os.open(fifo, os.O_WRONLY)
            try:
                os.write(fd, b"not a tensor file")
            except BrokenPipeError:
                pass
            finally:
                os.close(fd)

        threading.Thread(target=feed, daemon=True).start()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    recs = records(out)
    files = [r["path"] for r in recs if r["type"] == "file"]
    assert sorted(files) == sorted([*local, str(fifo)])  # each file exactly once
    got = final_verdicts(recs)
    assert {p: v for p, v in got.items() if p != str(fifo)} == local
    fifo_rec = next(r for r in recs if r["type"] == "file" and r["path"] == str(fifo))
    assert fifo_rec["verdict"] == "corrupt"
    assert [p["code"] for p in fifo_rec["problems"]] == ["not_safetensors"]
