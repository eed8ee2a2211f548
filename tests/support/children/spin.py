"""A process that spins one core at normal priority until its parent is gone, after
saying ``spinning`` (``support.load.busy_cores``)."""

import os
import sys

parent = os.getppid()
sys.stdout.write("spinning\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(100000):
        pass
