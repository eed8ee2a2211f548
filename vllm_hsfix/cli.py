"""``vllm-hsfix``: status | verify | run | bootstrap-dir, and audit | repair.

Exit codes (for a Dockerfile ``RUN``; each subcommand's ``--help`` lists its own):
``status`` 0 fix in place or not needed, 1 it cannot apply or a ``--require`` fails, 2
no vLLM; ``verify`` 0 passed, 1 a check failed or a patch is not in place, 2 cannot run
here; ``run`` the command's own; 141 for any when the reader of stdout goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from .codes import Code
from .views import REQUIREMENTS

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"


PIPE = "141 the reader of stdout went away (e.g. | head)"
STATUS_EXITS = f"""exit codes: 0 the fix is in place here or not needed; 1 a row this release
needs is disabled, refused or failed, the plugin is not registered or filtered out by
VLLM_PLUGINS, or a --require does not hold; 2 no vLLM here (or usage); {PIPE}."""
VERIFY_EXITS = f"""exit codes: 0 verified; 1 a check failed, or a row this release needs is
not in place (disabled, refused, failed); 2 cannot run here (no vLLM, no torch, no GPU
for --device cuda, a target that does not import); {PIPE}."""
RUN_EXITS = """exit codes: the command's own; 2 no command given; 127 it cannot be run."""


def _print_hazards(found: dict[str, Any]) -> None:
    """The release's hazards that concern it, one line each (none: no header)."""
    shown = {k: h for k, h in found.items() if h["state"] not in ("not-affected", "fixed-upstream")}
    if shown:
        print("known hazards (vllm_hsfix.hazards):")
    for hid, h in shown.items():
        models = f" [only {h['models']}]" if h.get("models") else ""
        print(f"  {hid:<24} {h['state']:<22} {h['reason']}{models}")


def _print_backends(found: dict[str, Any] | None) -> None:
    """speculators' backends (hs-connectors) and the patches that reach each."""
    if not found:
        return
    print(f"hs-connectors {found['version']} (speculators' backends): patches that reach each")
    for name, b in found["backends"].items():
        reach = ", ".join(f"{pid}: {r}" for pid, r in b["patches"].items()) or "none apply here"
        print(f"  {name:<9} {b['relation']:<16} {reach}")
        if b["note"]:
            print(f"            {b['note']}")


def _print_status(report: dict[str, Any], problems: list[str]) -> None:
    v = report["vllm"]
    if v["present"]:
        print(
            f"vLLM: {v['version'] or v['raw_version']} ({v['distribution'] or v['source']}) "
            f"at {Path(v['location'] or '').parent}"
        )
        print(f"platform: {v['platform_reason']}")
    else:
        print("vLLM: not installed")
    print(
        f"tested build: {'yes' if report['tested_build']['tested'] else 'no'} "
        f"({report['tested_build']['reason']})"
    )
    read = report["releases_read"]
    if read["newer"]:
        print(
            f"release: newer than {read['last']}, the last one read; decided by code shape: "
            + (", ".join(read["by_shape"]) or "none")
        )
    for pid, p in report["patches"].items():
        print(f"  {pid:<24} {p['code']:<22} {p['reason']}")
    if v["present"]:
        _print_hazards(report.get("hazards", {}))
    _print_backends(report.get("hs_connectors"))
    act = report["activation"]
    ep = act["entry_point"]
    print(
        f"plugin entry point: {'registered' if ep['registered'] else 'MISSING'}"
        + (" (filtered out by VLLM_PLUGINS)" if ep["filtered_out_by_VLLM_PLUGINS"] else "")
    )
    print(
        f"bootstrap: {'usable' if act['bootstrap_usable'] else 'missing'} ({act['bootstrap_dir']})"
    )
    for w in report["config"]["warnings"]:
        print(f"warning: {w}")
    if not v["present"]:
        print("result: NO VLLM: " + "; ".join(problems))
        return
    if problems and all(p.startswith("--require") for p in problems):
        print("result: REQUIREMENT NOT MET: " + "; ".join(problems))
        return
    print("result: " + ("OK" if not problems else "FIX CANNOT APPLY: " + "; ".join(problems)))
    if not problems:
        print(f"        {_what_happens(report)}")


def _what_happens(report: dict[str, Any]) -> str:
    """One line an image builder can read: what vllm-hsfix will do with this vLLM."""
    codes = {p["code"] for p in report["patches"].values()}
    shaped = report["releases_read"]["by_shape"]
    if codes - {Code.NOT_NEEDED} == {Code.UPSTREAM_FIX} and not shaped:
        return "fixed upstream, nothing to do"
    if Code.APPLY in codes:
        applied = [pid for pid, p in report["patches"].items() if p["code"] == Code.APPLY]
        return f"will patch every vLLM process when it starts: {', '.join(applied)}"
    return "nothing to patch on this vLLM"


def _requirements(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in REQUIREMENTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown requirement(s) {unknown}; choose from {', '.join(REQUIREMENTS)}"
        )
    return names


def cmd_status(args: argparse.Namespace) -> int:
    from . import views

    report = views.static(BOOTSTRAP_DIR)
    code, problems = views.exit_code(report, args.require)
    report["ok"], report["problems"] = code == 0, problems
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_status(report, problems)
    return code


def cmd_verify(args: argparse.Namespace) -> int:
    from . import verify

    # vLLM logs to stdout; while it loads, stdout is stderr so --json output stays parseable.
    try:
        with contextlib.redirect_stdout(sys.stderr):
            code, report = verify.run(args.device)
    except Exception as exc:  # the report must come out whatever happens
        where = verify.origin(exc)
        code, report = 1, {"ok": False, "error": f"verify crashed: {exc!r} (raised at {where})"}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        if "error" in report:
            print(f"error: {report['error']}")
        for name, p in report.get("patches", {}).items():
            print(f"  {name:<24} {p['status']:<9} {p['reason']}")
        for c in report.get("checks", []):
            mark = "ok  " if c["ok"] else "FAIL"
            print(f"  [{mark}] {c['check']}" + (f" ({c['skipped']})" if c.get("skipped") else ""))
            for p in c.get("problems", []):
                print(f"         {p}")
        _print_hazards(report.get("hazards", {}))
        print("result: " + ("verified" if code == 0 else "NOT verified"))
    return code


def bootstrap_env(env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(BOOTSTRAP_DIR) not in parts:
        parts.insert(0, str(BOOTSTRAP_DIR))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print(
            "vllm-hsfix run: no command given (usage: vllm-hsfix run -- CMD ARGS...)",
            file=sys.stderr,
        )
        return 2
    try:
        os.execvpe(command[0], command, bootstrap_env())
    except OSError as exc:
        print(f"vllm-hsfix run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
    return 127


def cmd_bootstrap_dir(args: argparse.Namespace) -> int:
    print(BOOTSTRAP_DIR)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    ap = argparse.ArgumentParser(
        prog="vllm-hsfix",
        description="Right hidden states from extract_hidden_states on pinned vLLM releases "
        "0.17 on: upstream's fixes backported, gated by release, platform and code shape "
        "(`vllm-hsfix status` lists what is patched here and why)",
    )
    ap.add_argument("--version", action="version", version=f"vllm-hsfix {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "status",
        help="what is (or would be) patched here, without importing vLLM",
        epilog=STATUS_EXITS,
        formatter_class=raw,
    )
    p.add_argument("--json", action="store_true", help="the whole report as one JSON document")
    p.add_argument(
        "--require",
        type=_requirements,
        default=(),
        metavar="applied|fixed|tested",
        help="also exit 1 unless vllm-hsfix patches this vLLM (applied), the vLLM has the "
        "upstream fix (fixed), or this exact build was tested (tested); comma lists combine",
    )
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser(
        "verify",
        help="import vLLM, activate, and check the live patched code",
        epilog=VERIFY_EXITS,
        formatter_class=raw,
    )
    p.add_argument("--json", action="store_true", help="the whole report as one JSON document")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the checks run (default auto: cuda when a GPU is available, else cpu)",
    )
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser(
        "run",
        help="run CMD with vllm-hsfix active in it and its Python children",
        epilog=RUN_EXITS,
        formatter_class=raw,
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS...",
        help="the command to run, e.g. -- vllm serve MODEL or -- python train.py",
    )
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser(
        "bootstrap-dir",
        help="print the directory to put first on PYTHONPATH",
        epilog="exit codes: 0.",
    )
    p.set_defaults(fn=cmd_bootstrap_dir)
    from . import audit, repair

    audit.add_parser(sub)
    repair.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .audit import outfiles

    args = build_parser().parse_args(argv)
    return outfiles.run_guarded(args.fn, args)


if __name__ == "__main__":
    sys.exit(main())
