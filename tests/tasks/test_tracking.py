"""The tracking interface on its own: config validation before any write, metric names, a failing
backend dropped, and curves that survive a SIGKILL (each step flushed as it is logged)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conf.loader import load_config
from conf.schema import TRACKING_BACKENDS, ConfigError
from tasks.tracking import Tracker, flatten, metric_key
from tests.tracking_readers import mlflow_client, mlflow_history, tensorboard_scalars

ROOT = Path(__file__).resolve().parents[2]


def test_default_backend_is_tensorboard():
    assert load_config([]).tracking.backends == ["tensorboard"]
    assert load_config(["tracking.backends=[]"]).tracking.backends == []


def test_unknown_backend_fails_at_config_time():
    with pytest.raises(
        ConfigError, match=r"tracking.backends\[0\]='neptune' is not supported; .*tensorboard, mlflow, wandb"
    ):
        load_config(["tracking.backends=[neptune]"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(["tracking.backends=[mlflow,mlflow]"])


@pytest.mark.parametrize("backend", sorted(TRACKING_BACKENDS))
def test_uninstalled_backend_fails_with_the_install_command(backend, monkeypatch):
    module, install = TRACKING_BACKENDS[backend]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        load_config([f"tracking.backends=[{backend}]"])
    assert f"`{install}`" in str(err.value) and "\n" not in str(err.value)


def test_install_commands_pin_what_requirements_pin():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", (ROOT / "requirements.txt").read_text(), re.M))
    for _, install in TRACKING_BACKENDS.values():
        pkg, version = install.removeprefix("pip install ").split("==")
        assert pins.get(pkg) == version, f"{install!r}: requirements.txt pins {pkg}=={pins.get(pkg)}"


def test_a_bad_backend_config_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "tracking.backends=[neptune]",
            "--workspace",
            str(tmp_path / "ws"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "tracking.backends" in proc.stderr
    assert not (tmp_path / "ws").exists()


def test_metric_names_and_flattening():
    assert metric_key("eval_rl", "math", "pass@4") == "eval_rl/math/pass_at_4"
    assert flatten({"a": {"b": 1, "c": True, "d": "x", "e": None, "f": float("nan")}, "g": 2.5}, "s") == {
        "s/a/b": 1.0,
        "s/a/c": 1.0,
        "s/g": 2.5,
    }


class _Broken:
    name = "broken"

    def scalars(self, values, step):
        raise OSError("disk full")


class _Recorder:
    name = "recorder"

    def __init__(self):
        self.calls = []

    def scalars(self, values, step):
        self.calls.append((step, values))

    def summary(self, values):
        self.calls.append((None, values))


def test_a_failing_backend_is_dropped_and_the_others_go_on(caplog):
    rec = _Recorder()
    tracker = Tracker("r1", [_Broken(), rec])
    tracker.step_logger("rl")({"step": 1, "reward": 0.5})
    tracker.step_logger("rl")({"step": 2, "reward": 0.75})
    assert [b.name for b in tracker.backends] == ["recorder"]
    assert rec.calls == [(1, {"rl/reward": 0.5}), (2, {"rl/reward": 0.75})]
    assert sum("broken backend failed" in r.getMessage() for r in caplog.records) == 1


KILLED = """
import sys, time
from pathlib import Path
from conf.schema import TrackingConfig
from tasks.tracking import Tracker, open_backends
root = Path(sys.argv[1])
backends = open_backends(TrackingConfig(backends=["tensorboard", "mlflow"]), root, "killed-run", {})
tracker = Tracker("killed-run", backends)
log = tracker.step_logger("rl")
for step in range(1, 6):
    log({"step": step, "reward": step / 10})
print(tracker.backends[1].location["run"], flush=True)
time.sleep(600)
"""


def test_a_killed_run_keeps_every_logged_step(tmp_path):
    """Nothing is closed: what reached the trackers before SIGKILL is all there is."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        mlflow_run = proc.stdout.readline().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert mlflow_run, "the logging process died before logging"
    want = [(s, pytest.approx(s / 10)) for s in range(1, 6)]
    assert tensorboard_scalars(tmp_path / "tensorboard" / "killed-run")["rl/reward"] == want
    client = mlflow_client(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    assert mlflow_history(client, mlflow_run, "rl/reward") == want
    assert client.get_run(mlflow_run).info.status == "RUNNING"  # killed, never closed


def test_a_moved_workspace_keeps_its_tracker_locations(tmp_path):
    from conf.loader import load_config
    from core.workspace import Workspace
    from tasks.tracking import finish_run, locations, start_run

    old = Workspace.at(tmp_path / "old")
    tracker = start_run(load_config([]), old, "r1", "laminar run")
    tracker.log_metrics("rl", {"reward": 1.0}, 1)
    finish_run(tracker, "completed")
    assert locations(old, "r1")["tensorboard"]["logdir"] == str(
        (tmp_path / "old" / "tracking" / "tensorboard" / "r1").resolve()
    )
    (tmp_path / "old").rename(tmp_path / "new")
    logdir = Path(locations(Workspace.at(tmp_path / "new"), "r1")["tensorboard"]["logdir"])
    assert logdir == (tmp_path / "new" / "tracking" / "tensorboard" / "r1").resolve()
    assert tensorboard_scalars(logdir)["rl/reward"] == [(1, 1.0)]
