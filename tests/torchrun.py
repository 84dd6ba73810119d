"""`hasten train` under torchrun, for the tests that run it (CPU with gloo, or the GPUs there are)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:  # torchrun's static rendezvous needs a concrete port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hasten_train(settings: dict, out: Path, *extra: str, nproc: int = 2, timeout: int = 300):
    """Write `settings` beside `out`, run `torchrun --nproc_per_node nproc -m hasten train` into
    `out`, and return (out, metrics rows, stderr). stderr is also kept as out/stderr.txt. The run
    gets its own process group: a hang leaves no worker behind."""
    config = out.parent / f"{out.name}.yaml"
    config.write_text(json.dumps(settings))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "hasten", "train", "--config", str(config), "--output_dir", str(out),
           "--no_progress", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, err[-3000:]
    (out / "stderr.txt").write_text(err)
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return out, rows, err
