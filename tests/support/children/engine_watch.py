"""The repair's engine watch (``vllm_hsfix.repair.watch``) with stand-ins for vLLM's
processes, no vLLM (test_repair_watch.py).

``engine_watch.py ARGS.json`` (``{"titled": bool, "grace_s": float}``) starts an engine
core and its worker (titled ``VLLM::EngineCore`` / ``VLLM::Worker`` or not) and, titled,
a helper that ends on its own (no alarm); starts the watch, prints ``HSFIX_WATCH
[watched, core, worker]``, SIGKILLs the engine core and waits forever: only the watch
can end it (exit 5)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from vllm_hsfix.repair.watch import EngineWatch

WORKER = "import time\ntime.sleep(600)\n"
# The engine core: starts its worker (not holding the test's pipes), prints its pid,
# sleeps. (A process titled through argv[0] has no sys.executable: it is passed in.)
CORE = (
    "import subprocess, time\n"
    "w = subprocess.Popen({argv!r}, executable={exe!r}, stdout=-3, stderr=-3)\n"
    "print(w.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def main(args: dict) -> None:
    titled = args["titled"]
    worker_argv = ["VLLM::Worker" if titled else "python", "-c", WORKER]
    code = CORE.format(argv=worker_argv, exe=sys.executable)
    core = subprocess.Popen(
        ["VLLM::EngineCore" if titled else "python", "-c", code],
        executable=sys.executable,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert core.stdout is not None
    worker = int(core.stdout.readline())
    if titled:  # ends on its own while the engine runs: must raise no alarm
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    watch = EngineWatch(grace_s=args["grace_s"])
    watch.start()
    print(
        "HSFIX_WATCH " + json.dumps([sorted(p.pid for p in watch.watched), core.pid, worker]),
        flush=True,
    )
    time.sleep(1.0)  # the helper has ended meanwhile
    os.kill(core.pid, signal.SIGKILL)
    threading.Event().wait()  # as vLLM's generate after its engine core is gone


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        main(json.load(f))
