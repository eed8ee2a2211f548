#!/usr/bin/env python3
"""The ``upstream`` row: vLLM's own tests of each backported fix, run unchanged on the
releases the patch covers, with vllm-hsfix active and without it.

``python3 scripts/upstream_tests.py`` (or ``scripts/run_tests.py --only upstream``).

What runs is listed in ``tests/upstream/upstream_tests.toml`` (its header explains the
fields): per fix, the file and the test functions, the releases the patch covers that
CI builds, the release that ships the fix, and anything that cannot run on a release
with the exact reason. Nothing of vLLM's is kept in this repository:

* ``source = "sdist:X"``: vLLM X's sdist from PyPI (found through the index's PEP 691
  JSON, the API pip uses; sha256 checked), downloaded once into
  ``~/.cache/vllm-hsfix/sdists``; its ``tests/`` tree is unpacked once into
  ``~/.cache/vllm-hsfix/upstream/vllm-X``;
* ``source = "github:owner/repo@commit"``: one file at that commit (immutable), read
  once from raw.githubusercontent.com into ``~/.cache/vllm-hsfix/upstream``; where the
  machine cannot reach it (and the cache lacks it), the suite is reported
  ``unavailable`` with the error, counted apart and printed, never passed.

Each suite runs, in each release's environment of ``scripts/vllm_env.py``, from a
temporary directory with the source's tree as pytest's rootdir, vLLM's conftest files
from the suite's ``conftest`` directory down, and ``-p hsfix_upstream_plugin``
(``tests/upstream``): vllm-hsfix imported first, as a user's script does. Per covered
release twice: ``patched`` (every listed test must pass, and the suite's patches must
report ``applied``) and ``unpatched`` (``VLLM_HSFIX_DISABLE=1``: the release as shipped;
every listed test must FAIL, except the ones the list says pass there too, with why).
On a release that ships the fix, every listed test must pass. Anything else (a skip,
an error, a test not collected, a patch not applied) is a failure of the row.

Suites marked ``extended = true`` (engine-level tests) run only with ``--extended``
(``run_tests.py --extended`` passes it on); otherwise their tests are listed "not run".
A suite's ``setup`` prepares its runs (``SETUPS``). A run whose tests are all listed as
not runnable starts no pytest.

Prints one line per test and run, then ``upstream: N as expected, N not as expected,
N not run (listed)``; ``--json PATH`` writes the same for ``run_tests.py``. Exit status 1
when anything is not as expected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib  # Python 3.11+: the driver runs on the main Python (run_tests.py)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import remote_wheel  # noqa: E402
import vllm_env  # noqa: E402

LIST = ROOT / "tests" / "upstream" / "upstream_tests.toml"
PLUGIN_DIR = ROOT / "tests" / "upstream"
PLUGIN = "hsfix_upstream_plugin"
SDISTS = vllm_env.CACHE / "sdists"
TREES = vllm_env.CACHE / "upstream"
RAW = "https://raw.githubusercontent.com"
RUN_TIMEOUT = 600
PATCHED, UNPATCHED, FIXED = "patched", "unpatched", "fixed"
# Per-suite preparations (the toml's `setup`). "offline-tinyllama": the tests ask the HF
# hub (unreachable here) for TinyLlama's config or tokenizer; the run gets a temporary HOME
# whose HF cache holds TinyLlama's config.json and a small stand-in LlamaTokenizerFast
# (tests/upstream/offline_tinyllama.py), and HF_HUB_OFFLINE=1. The user's real cache is
# never read or written.
SETUPS = ("", "offline-tinyllama")


def say(msg: str) -> None:
    print(f"[upstream] {msg}", flush=True)


@dataclass(frozen=True)
class Suite:
    id: str
    upstream: str
    patches: tuple[str, ...]
    source: str
    file: str
    conftest: str
    patched: tuple[str, ...]
    fixed: tuple[str, ...]
    tests: tuple[str, ...]
    unpatched_passes: dict[str, str] = field(default_factory=dict)
    not_runnable: dict[str, str] = field(default_factory=dict)  # "test @ release" -> why
    shims: dict[str, list[str]] = field(default_factory=dict)
    setup: str = ""  # "offline-tinyllama": see SETUPS
    extended: bool = False  # engine runs: only with --extended (CI time)

    def skip_reason(self, test: str, release: str) -> str | None:
        return self.not_runnable.get(f"{test} @ {release}")


def load(path: Path = LIST) -> list[Suite]:
    data = tomllib.loads(path.read_text())
    suites = []
    for raw in data["suite"]:
        suite = Suite(
            id=raw["id"],
            upstream=raw["upstream"],
            patches=tuple(raw["patches"]),
            source=raw["source"],
            file=raw["file"],
            conftest=raw["conftest"],
            patched=tuple(raw["patched"]),
            fixed=tuple(raw["fixed"]),
            tests=tuple(raw["tests"]),
            unpatched_passes=dict(raw.get("unpatched_passes", {})),
            not_runnable=dict(raw.get("not_runnable", {})),
            shims={k: list(v) for k, v in raw.get("shims", {}).items()},
            setup=raw.get("setup", ""),
            extended=bool(raw.get("extended", False)),
        )
        if suite.setup not in SETUPS:
            raise SystemExit(f"{path}: suite {suite.id}: unknown setup {suite.setup!r}")
        unknown = set(suite.unpatched_passes) | {k.split(" @ ")[0] for k in suite.not_runnable}
        unknown -= set(suite.tests)
        if unknown:
            raise SystemExit(f"{path}: suite {suite.id} names tests it does not list: {unknown}")
        suites.append(suite)
    return suites


# ---------------------------------------------------------------------------
# Sources


def sdist(version: str) -> Path:
    """vLLM ``version``'s sdist, downloaded once (sha256 from the index checked)."""
    name = f"vllm-{version}.tar.gz"
    dest = SDISTS / name
    if dest.exists():
        return dest
    SDISTS.mkdir(parents=True, exist_ok=True)
    files = [f for f in remote_wheel.index_files("vllm") if f["filename"] == name]
    if not files:
        raise RuntimeError(f"{name} is not on {remote_wheel.INDEX}")
    url, want = str(files[0]["url"]), str(files[0]["hashes"]["sha256"])
    say(f"download {name} ({int(files[0]['size']) / 1e6:.0f} MB) ...")
    part = dest.with_suffix(".part")
    digest = hashlib.sha256()
    req = urllib.request.Request(url, headers={"User-Agent": "vllm-hsfix-tests"})
    with urllib.request.urlopen(req, timeout=120) as resp, part.open("wb") as out:
        while chunk := resp.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != want:
        part.unlink()
        raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} is not the index's {want}")
    part.rename(dest)
    return dest


def sdist_tree(version: str) -> Path:
    """The ``tests/`` tree of the sdist, unpacked once; returns the tree's root."""
    root = TREES / f"vllm-{version}"
    stamp = root / ".unpacked"
    if stamp.exists():
        return root
    archive = sdist(version)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    prefix = f"vllm-{version}/tests/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isreg()]
        for m in members:
            m.name = m.name[len(f"vllm-{version}/") :]
            tar.extract(m, root, filter="data")
    stamp.write_text(hashlib.sha256(archive.read_bytes()).hexdigest() + "\n")
    return root


def github_tree(spec: str, file: str) -> Path:
    """One file of ``owner/repo@commit``, read once (a commit's file never changes)."""
    repo, commit = spec.split("@", 1)
    root = TREES / f"github-{repo.replace('/', '-')}-{commit[:12]}"
    dest = root / file
    if dest.exists():
        return root
    url = f"{RAW}/{repo}/{commit}/{file}"
    req = urllib.request.Request(url, headers={"User-Agent": "vllm-hsfix-tests"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        data = resp.read()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return root


def source_root(suite: Suite) -> Path | str:
    """The suite's tree, or why it is unavailable."""
    kind, _, spec = suite.source.partition(":")
    try:
        if kind == "sdist":
            return sdist_tree(spec)
        if kind == "github":
            return github_tree(spec, suite.file)
        return f"unknown source kind {suite.source!r}"
    except (OSError, urllib.error.URLError, RuntimeError, remote_wheel.RemoteError) as exc:
        return f"{suite.source}: {type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------
# Runs


def outcomes(junit: Path) -> dict[str, str]:
    """Test function name -> passed / failed / error / skipped (a parametrised function
    counts as failed if any case fails)."""
    got: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
    if not junit.exists():
        return got
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "").split("[", 1)[0]
        kinds = {child.tag for child in case}
        result = (
            "error"
            if "error" in kinds
            else "failed"
            if "failure" in kinds
            else "skipped"
            if "skipped" in kinds
            else "passed"
        )
        if rank[result] >= rank.get(got.get(name, "passed"), 0):
            got[name] = result
    return got


def run_suite(
    suite: Suite, root: Path, release: str, py: Path, overlay: Path, mode: str
) -> tuple[dict[str, str], dict[str, Any], float, str]:
    """One pytest run of the suite's runnable tests; returns outcomes, vllm-hsfix's
    status at the end, seconds, and the output's tail."""
    tests = [t for t in suite.tests if suite.skip_reason(t, release) is None]
    with tempfile.TemporaryDirectory(prefix="vllm-hsfix-upstream-") as tmp:
        work = Path(tmp)
        (work / "pytest.ini").write_text("[pytest]\n")
        junit, status = work / "junit.xml", work / "status.json"
        env = {k: v for k, v in vllm_env.env_for(overlay).items() if not k.startswith("VLLM_HSFIX")}
        env["PYTHONPATH"] = os.pathsep.join([str(PLUGIN_DIR), env.get("PYTHONPATH", "")])
        env["VLLM_HSFIX_CACHE"] = str(vllm_env.CACHE)
        env["VLLM_HSFIX_UPSTREAM_SHIMS"] = json.dumps(suite.shims)
        env["VLLM_HSFIX_UPSTREAM_STATUS"] = str(status)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.pop("VIRTUAL_ENV", None)
        if suite.setup == "offline-tinyllama":
            home = work / "home"
            hf = home / ".cache" / "huggingface"
            subprocess.run(
                [str(py), str(PLUGIN_DIR / "offline_tinyllama.py"), str(hf)],
                env=env, check=True, capture_output=True, timeout=300,
            )  # fmt: skip
            env.update(HOME=str(home), HF_HOME=str(hf), HF_HUB_OFFLINE="1")
            env["TRANSFORMERS_OFFLINE"] = "1"
        if mode == UNPATCHED:
            env["VLLM_HSFIX_DISABLE"] = "1"
        cmd = [
            str(py), "-m", "pytest", "-c", str(work / "pytest.ini"), f"--rootdir={root}",
            f"--confcutdir={root / suite.conftest}", "-p", PLUGIN, "-p", "no:cacheprovider",
            "-q", "-rfE", f"--junitxml={junit}",
            *(f"{root / suite.file}::{t}" for t in tests),
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=work, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
            )
            tail = (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as exc:
            tail = f"timed out after {RUN_TIMEOUT} s: {exc}"
        took = time.monotonic() - t0
        st = json.loads(status.read_text()) if status.exists() else {}
        return outcomes(junit), st, took, tail


def expected(suite: Suite, test: str, mode: str) -> str:
    if mode == UNPATCHED and test not in suite.unpatched_passes:
        return "failed"
    return "passed"


def judge(
    suite: Suite, release: str, mode: str, got: dict[str, str], status: dict[str, Any]
) -> list[dict[str, Any]]:
    patches = status.get("patches", {})
    wrong_patch = []
    for pid in suite.patches:
        state = patches.get(pid)
        if mode == PATCHED and state != "applied":
            wrong_patch.append(f"{pid} is {state!r}, not applied")
        if mode != PATCHED and state == "applied":
            wrong_patch.append(f"{pid} is applied in a {mode} run")
    rows = []
    for test in suite.tests:
        row = {"suite": suite.id, "test": test, "release": release, "mode": mode}
        why = suite.skip_reason(test, release)
        if why is not None:
            rows.append({**row, "result": "not run", "ok": None, "why": why})
            continue
        result = got.get(test, "not collected")
        want = expected(suite, test, mode)
        ok = result == want and not wrong_patch
        note = "; ".join(wrong_patch) if wrong_patch else ""
        if result == want and mode == UNPATCHED and want == "passed":
            note = suite.unpatched_passes[test]
        rows.append({**row, "result": result, "expected": want, "ok": ok, "why": note})
    return rows


def plan(
    suites: list[Suite], releases: set[str] | None, extended: bool = True
) -> list[tuple[Suite, str, str]]:
    runs = []
    for suite in suites:
        if suite.extended and not extended:
            continue
        for release in suite.patched:
            runs += [(suite, release, PATCHED), (suite, release, UNPATCHED)]
        runs += [(suite, release, FIXED) for release in suite.fixed]
    return [r for r in runs if releases is None or r[1] in releases]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--releases", default=None, help="only runs on these releases (A,B)")
    ap.add_argument("--suite", default=None, help="only these suites (ids, A,B)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--extended", action="store_true", help="also the suites marked extended (engine runs)"
    )
    args = ap.parse_args(argv)
    suites = load()
    if args.suite:
        wanted = set(args.suite.split(","))
        suites = [s for s in suites if s.id in wanted]
    releases = set(args.releases.split(",")) if args.releases else None
    runs = plan(suites, releases, args.extended)
    t0 = time.monotonic()
    envs = {r: (py, ov) for r, py, ov in vllm_env.ensure(sorted({r for _, r, _ in runs}))}
    roots = {s.id: source_root(s) for s in suites}
    rows: list[dict[str, Any]] = [
        {"suite": s.id, "test": t, "release": r, "mode": m, "result": "not run", "ok": None,
         "why": s.skip_reason(t, r) or "an extended suite (engine runs): run with --extended"}
        for s, r, m in plan([s for s in suites if s.extended], releases) if not args.extended
        for t in s.tests
    ]  # fmt: skip
    for suite, release, mode in runs:
        root = roots[suite.id]
        if isinstance(root, str):
            rows += [
                {"suite": suite.id, "test": t, "release": release, "mode": mode,
                 "result": "unavailable", "ok": None, "why": root}
                for t in suite.tests
            ]  # fmt: skip
            continue
        if all(suite.skip_reason(t, release) for t in suite.tests):
            rows += judge(suite, release, mode, {}, {})  # each test listed not runnable
            continue
        py, overlay = envs[release]
        got, status, took, tail = run_suite(suite, root, release, py, overlay, mode)
        judged = judge(suite, release, mode, got, status)
        say(f"{suite.id} on {release} {mode}: {len(got)} run in {took:.0f} s")
        if any(r["ok"] is False for r in judged):
            print(tail, flush=True)
        rows += judged
    return report(rows, args.json, time.monotonic() - t0)


def report(rows: list[dict[str, Any]], json_path: str | None, took: float) -> int:
    print(flush=True)
    for r in rows:
        mark = {True: "ok  ", False: "FAIL", None: "--  "}[r["ok"]]
        want = f" (expected {r['expected']})" if r.get("expected") else ""
        why = f": {r['why']}" if r.get("why") else ""
        print(f"  {mark} {r['suite']:<6} {r['release']:<7} {r['mode']:<9} {r['test']}: "
              f"{r['result']}{want}{why}")  # fmt: skip
    counts = {
        "passed": sum(r["ok"] is True for r in rows),
        "failed": sum(r["ok"] is False for r in rows),
        "skipped": sum(r["ok"] is None for r in rows),
    }
    say(
        f"{counts['passed']} as expected, {counts['failed']} not as expected, "
        f"{counts['skipped']} not run (listed, with the reason) in {took:.0f} s"
    )
    if json_path:
        Path(json_path).write_text(json.dumps({"counts": counts, "rows": rows}, indent=1))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
