"""``killed_step_writer.py WORK CONNECTOR_MODULE``: 0.17-0.21's in-step save (the
release's ``save_kv_layer`` on its own metadata, 8 MB of hidden states) killed at a 1 MB
file-size limit, release and patched, with safetensors < 0.8.0's in-place write; prints
what a reader finds at the path and the temporary files left, as one JSON line."""

import importlib
import json
import os
import resource
import signal
import sys
from types import SimpleNamespace

import torch
from safetensors.torch import save, save_file
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionMetadata

from support import torn
from vllm_hsfix.patches.atomic_writes_in_step import fix
from vllm_hsfix.patches.hooks import Hooks

torch.set_num_threads(1)  # a forked worker must not wait on the parent's OpenMP threads
LIMIT = 1 << 20  # the writer is killed (SIGXFSZ) when a file grows past 1 MB
BLOCK, BLOCKS = 16, 128  # 2048 tokens of 4 x 256 float32 values: 8 MB
work = sys.argv[1]
module = importlib.import_module(sys.argv[2])
cls = module.ExampleHiddenStatesConnector
old = {"hidden_states": torch.ones(4, 2, 3), "token_ids": torch.arange(4)}


def in_place(tensors, filename, metadata=None):
    # What safetensors < 0.8.0 does: open the final path with O_TRUNC, write.
    with open(filename, "wb") as fh:
        fh.write(save(tensors, metadata=metadata))


def one(case, patched):
    final = os.path.join(work, case + ".safetensors")
    save_file(old, final)
    conn = cls.__new__(cls)
    conn.cache_layers, conn._storage_path = ["hs"], work
    meta = module.ExampleHiddenStatesConnectorMetadata()
    meta.add_request(case, final, list(range(BLOCK * BLOCKS)), list(range(BLOCKS)), BLOCK)
    conn._connector_metadata = meta
    kv = torch.zeros(BLOCKS, BLOCK, 4, 256)
    reps = fix.apply(module, fix.SHAPE, Hooks(print)) if patched else []
    pid = os.fork()
    if pid == 0:  # the worker: killed by the kernel at the limit, as by the OOM killer
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))
        step = CacheOnlyAttentionMetadata(meta.requests[0].slot_mapping)
        cls.save_kv_layer(conn, "hs", kv, step)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    for r in reps:
        r.restore()
    return torn.found(final, old, status, work)


module.safetensors = SimpleNamespace(torch=SimpleNamespace(save_file=in_place))
out = {"release": one("a", False), "patched": one("b", True)}
print(json.dumps(out))
