"""``vllm-hsfix audit --ray`` on a real local two-node Ray cluster (the ``ray`` row; skipped
where Ray is missing). Expected verdicts come from the damage and the local run."""

from __future__ import annotations

import contextlib
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
from support.load import busy_cores
from support.npfiles import causal_dataset

ray = pytest.importorskip("ray", reason="Ray is not installed (the ray row of run_tests.py)")

from vllm_hsfix.audit import pipeline  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


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


def _wait_dead(pid: int, timeout: float) -> None:
    """Until ``pid`` has left ``open()`` for good (a zombie, or gone): a starved SIGKILLed reader
    still counts as the FIFO's reader until the kernel runs its exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"the killed Ray worker {pid} still runs after {timeout:.0f} s")


def _feed(fifo: Path) -> None:
    """Write to whichever reader opens ``fifo`` next (the retried batch)."""
    fd = os.open(fifo, os.O_WRONLY)
    try:
        os.write(fd, b"not a tensor file")
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


def _release(fifo: Path) -> None:
    """Let a reader still blocked on ``fifo`` go (none: nothing to do)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy-cores"])
def test_a_worker_killed_mid_scan_loses_nothing_and_counts_nothing_twice(
    tmp_path: Path, cluster: str, busy: bool
) -> None:
    """A worker SIGKILLed mid-batch (held in ``open()`` on a FIFO, every core busy): Ray re-runs
    the batch and every file comes back exactly once with the local verdicts."""
    root = tmp_path / "d"
    causal_dataset(root, 40, wrong=frozenset({3}))
    local = dict(pipeline.audit_paths([root], workers=2).verdicts)
    fifo = root / "f0015x.safetensors"  # mid-batch, after f0015 in sorted order
    os.mkfifo(fifo)
    with busy_cores() if busy else contextlib.nullcontext():
        t0 = time.monotonic()
        # --stall-timeout: should the retry never come back, a clear error, not a hang.
        proc = cli(str(root), "--ray", cluster, "--jsonl", "-", "--no-progress",
                   "--stall-timeout", "120")  # fmt: skip
        try:
            victim = _stalled_ray_worker(120)
            os.kill(victim, signal.SIGKILL)
            _wait_dead(victim, 60)
            threading.Thread(target=_feed, args=(fifo,), daemon=True).start()
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
            _release(fifo)
        took = time.monotonic() - t0
    assert proc.returncode == 1, err
    print(f"audit --ray with a worker killed ({'busy cores' if busy else 'idle'}): {took:.1f} s")
    assert all(x.startswith("{") for x in out.splitlines() if x), out  # JSONL only
    recs = records(out)
    files = [r["path"] for r in recs if r["type"] == "file"]
    assert sorted(files) == sorted([*local, str(fifo)])  # each file exactly once
    got = final_verdicts(recs)
    assert {p: v for p, v in got.items() if p != str(fifo)} == local
    fifo_rec = next(r for r in recs if r["type"] == "file" and r["path"] == str(fifo))
    assert fifo_rec["verdict"] == "corrupt"
    assert [p["code"] for p in fifo_rec["problems"]] == ["not_safetensors"]


def test_a_batch_that_never_comes_back_ends_the_run_naming_it(tmp_path: Path, cluster: str) -> None:
    """A FIFO nobody writes holds its task forever: with ``--stall-timeout 8`` the run exits 2
    naming the stuck batch, reports every other file once and cancels the task."""
    root = tmp_path / "d"
    causal_dataset(root, 12)  # 13 files on 2 CPUs: batches of 2, the FIFO alone in the last
    fifo = root / "f0011x.safetensors"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    proc = cli(str(root), "--ray", cluster, "--jsonl", "-", "--no-progress",
               "--stall-timeout", "8")  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    assert proc.returncode == 2, err
    line = next((x for x in err.splitlines() if "no batch of files came back" in x), None)
    assert line is not None, err[-3000:]
    assert f"for 8 s (--stall-timeout): 1 still out, not judged: {fifo}. " in line, line
    files = [r["path"] for r in records(out) if r["type"] == "file"]
    assert sorted(files) == sorted(str(p) for p in root.iterdir() if p != fifo)  # once each
    assert took < 60, f"a stalled Ray run took {took:.0f} s to end"
    deadline = time.monotonic() + 30  # the cancelled task's worker is gone
    while _blocked_on_fifo() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _blocked_on_fifo(), "the stuck task was left running"
    _release(fifo)


def _blocked_on_fifo() -> list[int]:
    try:
        return [_stalled_ray_worker(0.05)]
    except AssertionError:
        return []
