"""Run a worker script of the tests in two gloo processes under ``torchrun`` and read what each
rank wrote (``OUT/rank{r}.pt``)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(worker: str, out) -> list:
    """``[rank 0's, rank 1's]`` results of ``tests/<worker>`` run with ``out`` as its argument."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
               [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           os.path.join(HERE, worker), str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(out / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
