"""``killed_writer.py WORK CONNECTOR_MODULE``: the writer (release or patched, with an
in-place or the installed ``save_file``) killed at a 1 MB file-size limit; prints what a
reader finds at the path and what temporary files are left, as one JSON line."""

import fcntl
import importlib
import json
import os
import resource
import signal
import sys

import safetensors
import torch
from safetensors.torch import save, save_file

from support import torn
from vllm_hsfix.patches.atomic_writes import fix as atomic_writes
from vllm_hsfix.patches.hooks import Hooks

LIMIT = 1 << 20  # the writer is killed (SIGXFSZ) when a file grows past 1 MB
work = sys.argv[1]
module = importlib.import_module(sys.argv[2])
cls = module.ExampleHiddenStatesConnector
old = {"hidden_states": torch.ones(4, 2, 3), "token_ids": torch.arange(4)}
new = {"hidden_states": torch.zeros(2048, 4, 256), "token_ids": torch.arange(2048)}  # 8 MB


class Done:
    def synchronize(self):
        return None


def in_place(tensors, filename, metadata=None):
    # What safetensors < 0.8.0 does: open the final path with O_TRUNC, write.
    with open(filename, "wb") as fh:
        fh.write(save(tensors, metadata=metadata))


def one(case, patched, writer):
    final = os.path.join(work, case + ".safetensors")
    save_file(old, final)
    if writer is not None:
        module.save_file = writer
    reps = atomic_writes.apply(module, atomic_writes.SHAPE, Hooks(print)) if patched else []
    pid = os.fork()
    if pid == 0:  # the writer: killed by the kernel at the limit, as by the OOM killer
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
        fd = os.open(final + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        cls._write_tensors(new, Done(), final, fd)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    for r in reps:
        r.restore()
    with open(final + ".lock") as lf:  # a reader: the dead writer's lock is released
        fcntl.flock(lf, fcntl.LOCK_SH)
        return torn.found(final, old, status, work)


real = module.save_file
out = {
    "release-in-place": one("a", False, in_place),
    "patched-in-place": one("b", True, in_place),
    "release-installed": one("c", False, real),
    "patched-installed": one("d", True, real),
}
out["safetensors"] = safetensors.__version__
print(json.dumps(out))
