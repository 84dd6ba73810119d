"""Shared harness of the bad-input suite: run `hasten train` (in process, as the CLI runs it) and
check what every case must show: the exit code, a message that names the problem and the fix, and
that no file that existed before the run was lost or changed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from hasten.cli.main import main

# A tiny embedded-default job that trains in about a second on the CPU.
TINY = """\
model:
  default_size: tiny
training:
  max_tokens: 512
  max_steps: 2
  learning_rate: 0.003
  warmup_steps: 1
  logging_steps: 1
  device: cpu
logging:
  gpu_monitor: false
"""


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by path relative to it."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Outcome:
    rc: int
    out: str
    err: str
    lost: list[str]      # files that existed before and are gone
    changed: list[str]   # files that existed before with other contents

    def assert_refused(self, *fragments: str, rc: int = 2) -> None:
        """Exit `rc`, every fragment (case-insensitive) in the error output, nothing lost or changed."""
        assert self.rc == rc, f"exit {self.rc}, expected {rc}; stderr:\n{self.err}"
        text = self.err.lower()
        for fragment in fragments:
            assert fragment.lower() in text, f"{fragment!r} not in the message:\n{self.err}"
        assert "traceback" not in text, f"a raw traceback instead of a message:\n{self.err}"
        self.assert_nothing_lost()

    def assert_nothing_lost(self) -> None:
        assert not self.lost, f"files lost: {self.lost}"
        assert not self.changed, f"files changed: {self.changed}"


def run_train(capsys, root: Path, *args: str, config: str | None = TINY, keep: Path | None = None) -> Outcome:
    """`hasten train --config root/job.yaml ARGS...` with the output folder root/out unless ARGS name one.

    Every file under `keep` (default: root) before the run must be there, unchanged, after it;
    callers whose case expects a change pass a narrower `keep`, or check `changed` themselves."""
    argv = ["train", "--no_progress"]
    if config is not None:
        path = root / "job.yaml"
        if not path.exists():
            path.write_text(config)
        argv += ["--config", str(path)]
    if "--output_dir" not in args:
        argv += ["--output_dir", str(root / "out")]
    argv += list(args)
    keep = keep or root
    before = snapshot(keep)
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    after = snapshot(keep)
    lost = sorted(set(before) - set(after))
    changed = sorted(k for k in before if k in after and before[k] != after[k])
    return Outcome(rc, captured.out, captured.err, lost, changed)
