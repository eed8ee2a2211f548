"""``python -m hsfix_demo``: the demo's command line (``scripts/demo.py`` runs it inside a
pinned vLLM environment). Not part of the wheel: users run the package, not its demo."""

from __future__ import annotations

import argparse

from . import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hsfix_demo",
        description="show the bug and the fix on this vLLM with a tiny hybrid model",
    )
    p.add_argument(
        "--cases",
        default="hybrid-mp,load-mp",
        help="comma list of: hybrid-mp, hybrid-1aux, dense-mp, chat-mp, moe-mp, load-mp, "
        "load-moe-mp, user-script, repair (default hybrid-mp,load-mp; the moe cases run "
        "only where vLLM's CPU MoE kernels exist; user-script runs a plain extraction "
        "script with vllm-hsfix off and on; repair writes a dataset without the fix and "
        "runs vllm-hsfix repair on it)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--workdir", default=None)
    return run.cli_entry(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
