"""The installed `laminar` command imports a team's own plug-in from the directory it runs in, as
`python -m` would (the console script puts only its own bin/ on sys.path), and `laminar status`
reports a plug-in that cannot be imported as a one-line config error, like `laminar run`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LAMINAR = Path(sys.executable).with_name("laminar")


def _status(cwd: Path, target: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the project comes from the install
    return subprocess.run(
        [str(LAMINAR), "status", "--workspace", str(cwd / "ws"), f"env.target={target}", "env.max_turns=4"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_installed_command_imports_a_plugin_from_the_directory_it_runs_in(tmp_path):
    assert LAMINAR.exists(), f"{LAMINAR}: the venv's console script (make installs it)"
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "agents.py").write_text("async def solve(client, task):\n    return 1.0\n")
    ok = _status(tmp_path, "my_pkg.agents:solve")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "rl           stale" in ok.stdout, ok.stdout
    missing = _status(tmp_path, "my_pkg.nothere:solve")
    assert missing.returncode == 2
    assert missing.stderr.startswith("laminar: config error: ") and "Traceback" not in missing.stderr
    assert "my_pkg.nothere:solve" in missing.stderr and "No module named 'my_pkg.nothere'" in missing.stderr
