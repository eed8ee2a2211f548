"""A stand-in vLLM process that says two things on its JSON channel and is killed halfway
through its third line, its grandchild still holding the pipe. No vLLM."""

import json
import os
import signal
import subprocess
import sys
import time

os.setpgrp()  # as the repair's vLLM process does
core = subprocess.Popen(["sleep", "600"])
print(json.dumps({"event": "bad_arg", "key": "k", "why": core.pid}), flush=True)
print(json.dumps({"event": "guard", "problems": []}), flush=True)
sys.stdout.write('{"event": "fi')
sys.stdout.flush()
time.sleep(2.5)
os.kill(os.getpid(), signal.SIGKILL)
