"""The real-vLLM runs of ``hsfix_demo.e2e``'s cases, once per session per (case, patched,
run index), shared by every test module that reads them."""

from __future__ import annotations

from pathlib import Path

from conftest import CACHE

from hsfix_demo import e2e, machine

_RESULTS: dict[tuple[str, bool, int], e2e.Result] = {}


def result(case: str, patched: bool, workdir: Path, run: int = 0) -> e2e.Result:
    key = (case, patched, run)
    if key not in _RESULTS:
        _RESULTS[key] = e2e.run_case(
            e2e.CASES[case], patched=patched, workdir=workdir, models=CACHE / "models"
        )
    r = _RESULTS[key]
    assert r.ok_run, r.error
    print(f"{case} {'patched' if patched else 'unpatched'} run {run}: {summary(r)}")
    return r


def summary(r: e2e.Result) -> str:
    return (
        f"{r.requests_correct}/{r.requests} requests and {r.rows_correct}/{r.rows} rows "
        f"correct, {r.rows_nan} NaN rows {r.nan_rows_by_aux}, {r.rows_zero} zero rows, "
        f"{r.steps} engine steps, {r.wall_s:.0f} s on {machine.describe_cpu(r.cpu)}"
    )
