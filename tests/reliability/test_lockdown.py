"""The scheduler and the sources are closed (issue 26, part 4).

- ``laminar serve``: its Prefect API refuses a request without the workspace's auth string (401), a
  state change without a CSRF token (403) and another web page's origin (CORS); a run of its
  deployment may choose only overrides: another ``workspace``, an unknown key, or a key naming a file,
  folder, executable or cluster is refused before anything is written.
- ``data.sources[].name`` is an identifier, checked when the config is composed: ``../..`` never
  becomes a folder outside the dataset artifact.
- A Ray the RL runtime starts locally listens on the loopback only, keeps token authentication on, and
  its token file is 0600.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conf.schema import ConfigError
from core.workspace import Workspace
from tests.configs import TINY_CURATED

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    for var in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "LAMINAR_SERVE_SPEC"):
        env.pop(var, None)
    return env


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


# ---- source names ------------------------------------------------------------------------------------

BAD_NAMES = ["../..", "../escape", "a/b", "..", ".hidden", "", "x" * 65, "/abs"]


def _pool(tmp_path: Path) -> Path:
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(5)))
    return pool


def _sources(name: str, pool: Path) -> str:
    return f"data.sources=[{{name: {json.dumps(name)}, path: {pool}, format: jsonl}}]"


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_source_name_that_is_not_an_identifier_is_refused_when_the_config_is_composed(tmp_path, name):
    from conf.loader import load_config

    with pytest.raises(ConfigError, match=re.escape("data.sources[0].name=") + ".*is not an identifier"):
        load_config(["data.source=files", _sources(name, _pool(tmp_path))])


def test_identifier_source_names_still_load(tmp_path):
    from conf.loader import load_config

    for name in ("pool", "math_train", "my-pool2", "_x"):
        cfg = load_config(["data.source=files", _sources(name, _pool(tmp_path))])
        assert cfg.data.sources[0].name == name


def test_the_snapshot_never_writes_a_source_outside_the_artifact(tmp_path):
    """Below the config check: the data stage's own snapshot refuses such a name too."""
    from conf.schema import SourceConfig
    from data_curation.sources import snapshot_sources

    pool, out = _pool(tmp_path), tmp_path / "artifact" / "out"
    out.mkdir(parents=True)
    before = _files(tmp_path)
    with pytest.raises(ValueError, match="not an identifier"):
        snapshot_sources([SourceConfig(name="../../escape", path=str(pool), format="jsonl")], out)
    assert _files(tmp_path) == before  # nothing written, inside the artifact or outside it


def test_laminar_run_with_a_traversing_source_name_exits_2_before_any_write(tmp_path):
    ws = tmp_path / "ws"
    pool = _pool(tmp_path)
    before = _files(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "data.source=files",
            _sources("../../escape", pool),
            "--until",
            "data",
            "--workspace",
            str(ws),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: data.sources[0].name='../../escape' is not an identifier" in proc.stderr
    assert _files(tmp_path) == before  # no workspace, no escaped folder


# ---- what a run of the served deployment may choose -------------------------------------------------------


@pytest.fixture
def served(tmp_path, monkeypatch):
    """This process as a flow run of `laminar serve` on workspace ``ws`` (the environment its runs inherit);
    ``run_pipeline`` replaced by a recorder, so nothing would run even if a check let a run through."""
    import flows.pipeline as pipeline
    from tasks.serving import SERVE_SPEC_ENV, served_parameters

    monkeypatch.delenv(SERVE_SPEC_ENV, raising=False)
    ws = Workspace.at(tmp_path / "ws")
    operator = [*TINY_CURATED, "rollout.vllm_python=/opt/vllm/bin/python"]
    params = served_parameters(ws, operator, [], None, "laminar serve --cron '0 3 * * *'  # scheduled run")
    monkeypatch.setenv(SERVE_SPEC_ENV, os.environ.pop(SERVE_SPEC_ENV))  # removed again after the test
    started: list[dict] = []

    class Ran(Exception):
        pass

    def record(cfg, ws_, pipeline_, **kw):
        started.append({"workspace": str(ws_.root), **kw})
        raise Ran

    monkeypatch.setattr(pipeline, "run_pipeline", record)
    return {
        "ws": ws,
        "params": params,
        "operator": operator,
        "started": started,
        "Ran": Ran,
        "run": pipeline.laminar_run.fn,
        "tmp": tmp_path,
    }


def test_the_deployment_offers_only_overrides_and_its_own_workspace(served):
    assert served["params"] == {"overrides": served["operator"], "workspace": str(served["ws"].root)}


def test_a_served_run_on_another_workspace_is_refused_before_any_write(served):
    from tasks.serving import ServeError

    other = served["tmp"] / "other"
    before = _files(served["tmp"])
    with pytest.raises(
        ServeError,
        match=re.escape(
            f"this deployment runs on workspace {served['ws'].root} only; "
            f"a run may not choose another (workspace='{other}' refused)"
        ),
    ):
        served["run"](overrides=None, workspace=str(other))
    assert served["started"] == [] and _files(served["tmp"]) == before and not other.exists()


@pytest.mark.parametrize(
    "override,why",
    [
        ("no_such.key=1", "config error: unknown config key 'no_such.key'"),
        ("rl.no_such_key=1", "config error: unknown config key 'rl.no_such_key'"),
        ("hydra.run.dir=/tmp/x", "config error: unknown config key 'hydra.run.dir'"),
        ("rl.lr=-1", "config error: rl.lr="),
        ("rollout.vllm_python=/bin/sh", "rollout.vllm_python is not among the keys a run's caller may set"),
        ("data.sources=[{name: x, path: /etc/passwd, format: jsonl}]", "data.sources is not among the keys"),
        ("data.sources[0].path=/etc/passwd", "data.sources.path is not among the keys"),
        ("model.path=/tmp/m", "model.path is not among the keys"),
        ("trainer.deepspeed=/tmp/ds.json", "trainer.deepspeed is not among the keys"),
        ("cluster.address=10.0.0.1:6379", "cluster.address is not among the keys"),
        ("tracking.mlflow_uri=sqlite:////tmp/any/path.db", "tracking.mlflow_uri is not among the keys"),
        ("eval.benchmarks=[{name: x, path: /etc/passwd}]", "eval.benchmarks takes a plain value here"),
        ("eval.benchmarks=[gsm8k,/etc/passwd]", "eval.benchmarks takes a plain value here"),
        ("reward_model.backbone=/tmp/m", "reward_model.backbone is not among the keys"),
        ("rl.critic_path=/tmp/m", "rl.critic_path is not among the keys"),
        ("sandbox.backend=unsafe", "sandbox.backend is not among the keys"),
        ("rl.lr=http://evil.example/x", "rl.lr takes a plain value here"),
        (
            "cluster={address: '10.0.0.1:6379'}",
            "a top-level key takes a plain value or a config group's option",
        ),
        ("data=../../../etc/x", "a top-level key takes a plain value"),
        ("+rl.extra=1", "a run's overrides are key=value or group=option"),
        ("~rl.lr", "a run's overrides are key=value or group=option"),
        ("rollout.dtype=${oc.env:HOME}", "no ${...} interpolation"),
    ],
)
def test_a_served_run_with_a_refused_override_fails_before_any_write(served, override, why):
    from tasks.serving import ServeError

    before = _files(served["tmp"])
    with pytest.raises(ServeError, match=re.escape(why)):
        served["run"](overrides=[*TINY_CURATED, override], workspace=str(served["ws"].root))
    assert served["started"] == [] and _files(served["tmp"]) == before


def test_a_served_run_may_pass_checked_overrides_and_the_operators_own(served):
    """Overrides on the allow-list pass (numbers, switches, names, lists of names, a config group's
    option); so does the command line's own ``rollout.vllm_python``."""
    allowed = ["rl.steps=1", "seed=3", "rl.mode=sync", "eval.benchmarks=[arith_heldout]", "data.levels=[1,2]"]
    with pytest.raises(served["Ran"]):
        served["run"](overrides=[*served["operator"], *allowed], workspace=None)
    (run,) = served["started"]
    assert run["workspace"] == str(served["ws"].root) and run["overrides"][-len(allowed) :] == allowed
    assert run["command"].endswith("# scheduled run")


def test_a_flow_run_outside_laminar_serve_is_refused(served, monkeypatch):
    from tasks.serving import SERVE_SPEC_ENV, ServeError

    monkeypatch.delenv(SERVE_SPEC_ENV)
    with pytest.raises(ServeError, match="runs only under `laminar serve`"):
        served["run"](overrides=list(TINY_CURATED), workspace=None)
    assert served["started"] == []


def test_the_served_api_secret_is_fresh_and_private_and_the_server_is_locked_down(tmp_path):
    from tasks.serving import auth_file, new_api_auth, read_api_auth, server_env

    ws = Workspace.at(tmp_path / "ws")
    first, second = new_api_auth(ws), new_api_auth(ws)
    assert first != second and read_api_auth(ws) == second and re.fullmatch(r"laminar:[\w-]{40,}", second)
    assert stat.S_IMODE(auth_file(ws).stat().st_mode) == 0o600
    env = server_env(ws, 4321, second)
    assert env["PREFECT_SERVER_API_AUTH_STRING"] == second == env["PREFECT_API_AUTH_STRING"]
    assert env["PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED"] == "true"
    assert env["PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS"] == "http://127.0.0.1:4321"
    # the UI is told the API on the server's own port, never Prefect's default 4200
    assert env["PREFECT_SERVER_UI_API_URL"] == "http://127.0.0.1:4321/api" and "PREFECT_UI_API_URL" not in env


# ---- the real `laminar serve` ------------------------------------------------------------------------------


@pytest.mark.slow
def test_laminar_serve_refuses_anonymous_calls_and_runs_that_choose_the_workspace_or_unknown_keys(tmp_path):
    import httpx

    ws, other = tmp_path / "ws", tmp_path / "other"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "serve",
            "--cron",
            "0 0 1 1 *",
            "--port",
            "0",
            *TINY_CURATED,
            "--workspace",
            str(ws),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=_env(PREFECT_RUNNER_POLL_FREQUENCY="2"),
    )
    lines: list[str] = []
    api: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Prefect API (http://127\.0\.0\.1:\d+/api)", line)
            if m:
                api.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()

    def log() -> str:
        return "".join(lines)[-4000:]

    try:
        deadline = time.monotonic() + 240
        while not api:
            assert proc.poll() is None and time.monotonic() < deadline, log()
            time.sleep(0.5)
        url = api[0]

        # no auth string, or a wrong one: a read gets 401, and so does the CSRF token a write would need
        # (a write without one gets 403 first); the health probe stays open
        assert httpx.get(f"{url}/admin/version", timeout=30).status_code == 401
        assert httpx.get(f"{url}/csrf-token", params={"client": "x"}, timeout=30).status_code == 401
        assert httpx.post(f"{url}/deployments/filter", json={}, timeout=30).status_code in (401, 403)
        wrong = {"Authorization": "Basic " + base64.b64encode(b"laminar:guess").decode()}
        assert httpx.get(f"{url}/admin/version", headers=wrong, timeout=30).status_code == 401
        assert (
            httpx.get(f"{url}/csrf-token", params={"client": "x"}, headers=wrong, timeout=30).status_code
            == 401
        )
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert stat.S_IMODE((ws / "prefect" / "api-auth").stat().st_mode) == 0o600
        from tests.served_api import ServedAPI

        client = ServedAPI(url, ws)
        # the auth string without a CSRF token: a state change is refused
        r = httpx.post(f"{url}/deployments/filter", json={}, headers=client.auth, timeout=30)
        assert r.status_code == 403 and "CSRF" in r.text
        # another web page's origin gets no CORS grant
        r = httpx.options(
            f"{url}/deployments/filter",
            timeout=30,
            headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert r.headers.get("access-control-allow-origin") in (None, "") and r.status_code >= 400

        deadline = time.monotonic() + 120
        while not (deps := client.call("/deployments/filter", {})):
            assert proc.poll() is None and time.monotonic() < deadline, log()
            time.sleep(1)
        (dep,) = deps
        assert set(dep["parameters"]) == {"overrides", "workspace"}
        # a `laminar run` on the served workspace attaches with the auth string; Prefect's own client then
        # reads and writes (CSRF token included)
        attach = (
            "import sys; from core.workspace import Workspace; from tasks.serving import attach_served_api\n"
            "assert attach_served_api(Workspace.at(sys.argv[1]))\n"
            "from prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as c:\n"
            "    print('deployments', len(c.read_deployments()),\n"
            "          'flow', c.create_flow_from_name('lockdown-probe'))\n"
        )
        probe = subprocess.run(
            [sys.executable, "-c", attach, str(ws)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert probe.returncode == 0 and "deployments 1 flow " in probe.stdout, probe.stderr[-3000:]
        before = _files(ws)

        # the UI is told the API of this server (its own port), not Prefect's default 4200
        ui = httpx.get(url.removesuffix("/api") + "/ui-settings", timeout=30).json()
        assert ui["api_url"] == url, ui
        # a run's parameters off the allow-list: 403 with the reason, no flow run created
        refused = {
            "workspace": {"workspace": str(other)},
            "unknown": {"overrides": [*TINY_CURATED, "no_such.key=1"]},
            "executable": {"overrides": ["rollout.vllm_python=/bin/sh"]},
            "mlflow": {"overrides": ["tracking.mlflow_uri=sqlite:////" + str(other / "x.db")]},
            "benchmark": {"overrides": [f"eval.benchmarks=[{{name: x, path: {other / 'b.jsonl'}}}]"]},
        }
        runs_before = client.call("/flow_runs/filter", {})
        reasons = {}
        for why, parameters in refused.items():
            r = httpx.post(
                f"{url}/deployments/{dep['id']}/create_flow_run",
                json={"parameters": parameters},
                headers={**client.auth, **client.csrf()},
                timeout=30,
            )
            assert r.status_code == 403, (why, r.status_code, r.text)
            reasons[why] = r.json()["detail"]
        # and a flow run created directly with such parameters, or a deployment's defaults changed
        r = httpx.post(
            f"{url}/flow_runs/",
            json={"flow_id": dep["flow_id"], "deployment_id": dep["id"], "parameters": refused["mlflow"]},
            headers={**client.auth, **client.csrf()},
            timeout=30,
        )
        assert r.status_code == 403, r.text
        r = httpx.patch(
            f"{url}/deployments/{dep['id']}",
            json={"parameters": refused["executable"]},
            headers={**client.auth, **client.csrf()},
            timeout=30,
        )
        assert r.status_code == 403, r.text
        assert len(client.call("/flow_runs/filter", {})) == len(runs_before)
        assert f"this deployment runs on workspace {ws} only" in reasons["workspace"]
        assert "unknown config key 'no_such.key'" in reasons["unknown"]
        assert "rollout.vllm_python is not among the keys a run's caller may set" in reasons["executable"]
        assert "tracking.mlflow_uri is not among the keys" in reasons["mlflow"]
        assert "eval.benchmarks takes a plain value here" in reasons["benchmark"]
        assert not other.exists()  # the other folder was never touched
        after = _files(ws)
        assert not any(p.startswith(("runs/", "artifacts/")) for p in after - before), after - before
        assert not (ws / "catalog.duckdb").exists() or not _runs(ws)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log()
    assert not (ws / "prefect" / "api-auth").exists()  # the secret goes with the server


def _runs(ws: Path) -> list:
    import duckdb

    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute("SELECT run_id FROM runs").fetchall()
    except duckdb.CatalogException:
        return []
    finally:
        con.close()


# ---- Ray started by the runtime -----------------------------------------------------------------------

RAY_PROBE = textwrap.dedent("""
    import ipaddress, json, os, sys
    import psutil
    from generation.model import (
        build_char_tokenizer, build_tiny_model, encode_problem, load_tokenizer, save_model,
    )
    from generation.records import PromptItem
    from tests.training.test_runtime import TINY, make_runtime

    model_dir = sys.argv[1]
    tok = build_char_tokenizer()
    save_model(build_tiny_model(TINY, tok, seed=0), tok, model_dir)
    tok = load_tokenizer(model_dir)
    prompts = [PromptItem(f"p{i}", f"{i % 7}+{i % 5}", str(i % 7 + i % 5),
                          encode_problem(tok, "{problem}\\n", f"{i % 7}+{i % 5}"), 1) for i in range(40)]
    seen = {}

    def on_step(m):
        if seen:
            return
        from ray._raylet import AuthenticationMode, get_authentication_mode

        me = psutil.Process()
        listening = set()
        for p in [me, *me.children(recursive=True)]:
            try:
                listening |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                              if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
        seen["listening"] = sorted(listening)
        seen["token_auth"] = get_authentication_mode() == AuthenticationMode.TOKEN

    make_runtime(model_dir, prompts, "sync", steps=2, on_step=on_step, rollouts=1).run()
    print("PROBE " + json.dumps(seen))
""")


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


@pytest.mark.slow
@pytest.mark.parametrize("token", ["missing", "existing-0644"])
def test_a_locally_started_ray_listens_on_the_loopback_only_and_its_token_file_is_0600(tmp_path, token):
    """A tiny sync run on the Ray runtime, in a fresh process with its own home (Ray's token file is
    ``~/.ray/auth_token``): every socket Ray's processes listen on is loopback while the run is active,
    token authentication is on, and the token file is 0600 (created so, or tightened, same token)."""
    home = tmp_path / "home"
    token_file = home / ".ray" / "auth_token"
    if token == "existing-0644":
        token_file.parent.mkdir(parents=True)
        token_file.write_text("ab" * 32)
        token_file.chmod(0o644)
    env = _env(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", RAY_PROBE, str(tmp_path / "model")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))[6:])
    names = {name for name, _, _ in seen["listening"]}
    assert {"gcs_server", "raylet"} <= names, seen  # Ray's servers were up when probed
    assert all(_loopback(ip) for _, ip, _ in seen["listening"]), seen["listening"]
    assert seen["token_auth"]
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    if token == "existing-0644":
        assert token_file.read_text() == "ab" * 32  # the user's token, kept
