"""The repair's engine watch with stand-ins for vLLM's processes: ``engine_watch.py
ARGS.json`` starts an engine core (with a worker) and a helper that ends on its own, prints
``HSFIX_WATCH [watched, core, worker]``, SIGKILLs the core and waits forever (exit 5 by the
watch only)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from vllm_hsfix.repair.engine import EngineWatch


def core(conn: Any) -> None:
    """The engine core: starts its worker (not holding the test's pipes), sends its pid, sleeps."""
    w = subprocess.Popen(["sleep", "600"], stdout=-3, stderr=-3)
    conn.send(w.pid)
    time.sleep(600)


def main(args: dict) -> None:
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    engine_core = ctx.Process(target=core, args=(theirs,), name="EngineCore")
    engine_core.start()
    worker = ours.recv()
    # Ends on its own while the engine runs: must raise no alarm.
    subprocess.Popen(["sleep", "0.3"])
    watch = EngineWatch(grace_s=args["grace_s"])
    watch.start()
    watched = [p.pid for p in watch.watched]
    print("HSFIX_WATCH " + json.dumps([watched, engine_core.pid, worker]), flush=True)
    time.sleep(1.0)  # the helper has ended meanwhile
    os.kill(engine_core.pid, signal.SIGKILL)
    threading.Event().wait()  # as vLLM's generate after its engine core is gone


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        main(json.load(f))
