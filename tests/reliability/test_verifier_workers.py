"""Verifier workers die with their parent. Issue 26, case 5: a parent killed alone (SIGKILL, as the
OOM killer does) left its math-verify workers running, one of them keeping a core busy until killed
by hand. Each worker now asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and
the pool is started from one long-lived thread, so a caller's thread that ends does not take the
workers with it (the kernel ties that signal to the thread that started them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = r"""
import json, os, sys, threading, time
sys.path.insert(0, ROOT)
from rewards.verifier import Verifier

if __name__ == "__main__":
    v = Verifier(timeout_s=30, workers=2)
    first = {}

    def score():  # the pool starts in a thread that then ends
        first["verdict"] = v.verify("\\boxed{\\frac{1}{2}}", "0.5").correct
        first["pids"] = sorted(v._pool._processes)

    t = threading.Thread(target=score)
    t.start()
    t.join()
    time.sleep(1.0)  # the starting thread is gone: its end must not have killed the workers
    again = v.verify("\\boxed{\\frac{2}{4}}", "0.5").correct
    print(json.dumps({"first": first, "again": again, "pids": sorted(v._pool._processes)}), flush=True)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_within_seconds_when_their_parent_is_sigkilled(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    workers: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, parent.stderr.read()[-3000:]
        report = json.loads(line)
        workers = report["pids"]
        assert report["first"] == {"verdict": True, "pids": workers} and report["again"] is True, report
        assert len(workers) == 2 and all(alive(p) for p in workers)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if alive(p)], "verifier workers outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in workers:  # never leave one behind, even when the test fails
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
