"""Operating the pipeline through the real CLI, on one tiny workspace: lineage, runs, rerun and
--until, two runs on one workspace, a run killed with SIGKILL mid-stage and rerun, an edited source
file, and `laminar serve --cron` with a triggered run.

Stage names come from the DAG (``tasks.dag.STAGES``), never from a list here; each test changes
its own config value, so the tests do not depend on their order."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import duckdb
import pytest

from core.workspace import Workspace
from tests.configs import TINY_CURATED
from tests.e2e import cli
from tests.served_api import ServedAPI
from tasks import cache
from tasks.dag import (
    DEFAULT_CONFIG,
    STAGE_BY_NAME,
    STAGES,
    active_inputs,
    downstream_of,
    stages_of,
    upstream_of,
)
from tasks.operate import orphan_prefect_servers, workspace_busy
from tasks.prefect_publish import artifact_key, asset_key

ROOT = Path(__file__).resolve().parents[2]
TINY = TINY_CURATED
NAMES = [s.name for s in stages_of()]  # the default run's stages

pytestmark = pytest.mark.e2e


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    env.pop("PREFECT_API_URL", None)  # every test talks to its own workspace's Prefect
    return env


def laminar(*args: str, ws: Path, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """``tests.e2e.cli.laminar`` in this module's environment (its own Prefect per workspace)."""
    return cli.laminar(*args, ws=ws, env=_env(), check=check, timeout=timeout)


def popen(*args: str, ws: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *args, "--workspace", str(ws)],
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
        **kw,
    )


def summaries(ws: Path) -> dict[str, dict]:
    return {
        p.name: json.loads((p / "summary.json").read_text())
        for p in (ws / "runs").iterdir()
        if (p / "summary.json").exists()
    }


def latest_summary(ws: Path) -> dict:
    return max(summaries(ws).values(), key=lambda s: s["run_id"])


def statuses(summary: dict) -> dict[str, str]:
    return {k: v["status"] for k, v in summary["stages"].items()}


def query(ws: Path, sql: str, params=()) -> list[tuple]:
    con = duckdb.connect(str(ws / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def final_checkpoint(summary: dict) -> tuple[str, str]:
    for stage in reversed(STAGES):
        arts = summary["stages"].get(stage.name, {}).get("artifacts", {})
        if "model" in arts:
            return stage.name, arts["model"]
    raise AssertionError("no stage made a model")


def middle_stage() -> str:
    """The last stage of the DAG that has inputs and readers (the cheapest to rerun with its downstream)."""
    return [
        s.name
        for s in STAGES
        if s.inputs and any(src == s.name for t in STAGES for src, _ in t.inputs.values())
    ][-1]


def own_module(stage) -> str:
    """The library module of ``stage`` that the fewest stages' source reaches (its own code)."""
    reach = {s.name: {m for m, _ in cache.module_closure(tuple(sorted(s.modules)))} for s in STAGES}
    return min(stage.modules, key=lambda m: (sum(m in r for r in reach.values()), m))


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    ws = tmp_path_factory.mktemp("operate_ws")
    laminar("run", *TINY, ws=ws)
    return ws, latest_summary(ws)


# ---- lineage and runs ---------------------------------------------------------------------------------


def test_lineage_cli_names_every_stage_prompts_and_openlineage(first):
    ws, summary = first
    stage, sha = final_checkpoint(summary)
    text = laminar("lineage", sha[:12], "--prompts", ws=ws).stdout
    for name in upstream_of([stage]):
        assert f"\n  {name}\n" in text and summary["stages"][name]["cache_key"] in text
    assert (
        "source fingerprint" in text and "sources (the roots of the tree)" in text and "evaluations:" in text
    )
    lin = json.loads(laminar("lineage", sha[:12], "--json", "--prompts", ws=ws).stdout)
    assert {n["stage"] for n in lin["stages"]} == upstream_of([stage])
    trajectories = summary["stages"][stage]["metrics"]["trajectories"]
    assert sum(p["n"] for p in lin["prompts"]["prompts"]) == trajectories > 0
    events = [
        json.loads(line)
        for line in laminar("lineage", sha[:12], "--format", "openlineage", ws=ws).stdout.splitlines()
        if line.strip()
    ]
    assert [e["job"]["name"] for e in events] == [n["stage"] for n in lin["stages"]]
    assert all(
        e["eventType"] == "COMPLETE" and uuid.UUID(e["run"]["runId"]) and e["job"]["namespace"]
        for e in events
    )
    assert events[-1]["outputs"][0]["facets"]["version"]["datasetVersion"] == sha
    bad = laminar("lineage", "abcdef0123", ws=ws, check=False)
    assert bad.returncode == 2 and "no artifact" in bad.stderr


def test_runs_lists_runs_and_checkpoints(first):
    ws, summary = first
    listing = json.loads(laminar("runs", "--json", ws=ws).stdout)
    run = next(r for r in listing["runs"] if r["run_id"] == summary["run_id"])
    assert run["status"] == "completed" and {s["stage"] for s in run["stages"]} == set(summary["stages"])
    _, sha = final_checkpoint(summary)
    assert sha in {c["sha256"] for c in listing["checkpoints"]}
    text = laminar("runs", ws=ws).stdout
    assert summary["run_id"] in text and sha[:12] in text
    # each run's command, so runs with different overrides can be told apart
    assert f"    command: {run['command']}" in text and "rl.steps=2" in run["command"]


@pytest.mark.slow
def test_a_copied_workspace_works_after_the_original_is_gone(first, tmp_path):
    """Copy a finished workspace, move the original out of reach: the copy runs fully cached, evaluates
    its checkpoint from its own store, its lineage names paths under it, `status` names a changed key
    and `rerun rl` still reports the warm-up and RFT accuracies (cached, from the catalog)."""
    ws, summary = first
    copy = tmp_path / "elsewhere" / "ws"
    shutil.copytree(ws, copy, symlinks=True)
    away = ws.with_name(ws.name + "-away")
    ws.rename(away)
    try:
        run = laminar("run", *TINY, ws=copy)
        moved = latest_summary(copy)
        assert set(statuses(moved).values()) == {"cached"} and moved["metrics"] == summary["metrics"], (
            statuses(moved)
        )
        # one progress line for the cached stages: "laminar: stages data, ingest, ... cached 0.4s"
        assert re.search(rf"^laminar: stages {NAMES[0]}, .*{NAMES[-1]} cached ", run.stdout, re.M), run.stdout

        stage, sha = final_checkpoint(summary)
        out = laminar(
            "eval", f"ckpt={sha[:12]}", "eval.n_samples=1", "eval.max_new_tokens=8", "seed=3", ws=copy
        )
        assert "arith_heldout" in out.stdout
        ev = max((s for s in summaries(copy).values() if s.get("kind") == "eval"), key=lambda s: s["run_id"])
        assert ev["status"] == "ran" and ev["checkpoint"]["path"] == f"artifacts/model/{sha}"

        lin = json.loads(laminar("lineage", sha[:12], "--json", ws=copy).stdout)
        paths = [lin["artifact"]["path"], *(a["path"] for a in lin["artifacts"].values())]
        assert len(paths) > 5 and all(Path(p).is_relative_to(copy) and Path(p).exists() for p in paths), paths
        text = laminar("lineage", sha[:12], ws=copy).stdout
        assert f"path {copy}/artifacts/model/{sha}" in text and str(ws) not in text

        status = laminar("status", *TINY, "rl.lr=0.0003", ws=copy).stdout
        assert "config (rl.lr 0.0001 -> 0.0003)" in next(
            line for line in status.splitlines() if line.startswith("rl ")
        )

        rerun = laminar("rerun", "rl", *TINY, ws=copy)
        again = max((s for s in summaries(copy).values() if "stages" in s), key=lambda s: s["run_id"])
        assert "eval_warmup" not in again["stages"] and again["metrics_from_catalog"] == [
            "eval_rft",
            "eval_warmup",
        ]
        for key in ("heldout_accuracy_warmup", "heldout_accuracy_rft"):
            assert again["metrics"][key] == summary["metrics"][key] is not None
        final = next(line for line in rerun.stdout.splitlines() if line.startswith("held-out accuracy"))
        assert "n/a" not in final and "(cached, from the catalog)" in final
    finally:
        away.rename(ws)


# ---- rerun and --until --------------------------------------------------------------------------------


def test_rerun_reruns_the_stage_and_its_downstream_only(first):
    ws, _ = first
    stage = middle_stage()
    laminar("rerun", stage, *TINY, ws=ws)
    st = statuses(latest_summary(ws))
    forced = downstream_of([stage])
    assert {k for k, v in st.items() if v == "ran"} == forced
    assert {k for k, v in st.items() if v == "cached"} == upstream_of(forced) - forced
    assert laminar("rerun", "no_such_stage", ws=ws, check=False).returncode == 2


def test_until_runs_only_the_stage_and_its_upstream(first):
    from conf.loader import load_config

    ws, summary = first
    stage, _ = final_checkpoint(summary)
    change = "rl.lr=0.0003"
    a, b = load_config(TINY), load_config([*TINY, change])
    changed = {s.name for s in STAGES if s.config(a) != s.config(b)}
    laminar("run", *TINY, change, "--until", stage, ws=ws)
    s = latest_summary(ws)
    assert set(s["stages"]) == upstream_of([stage])
    assert {k for k, v in statuses(s).items() if v == "ran"} == downstream_of(changed) & upstream_of([stage])
    bad = laminar("run", *TINY, "--until", "no_such_stage", ws=ws, check=False)
    assert bad.returncode == 2 and "stages are" in bad.stderr


# ---- concurrency and crashes ------------------------------------------------------------------------------


def test_a_second_run_on_a_busy_workspace_fails_at_once_and_writes_nothing(first, tmp_path):
    ws, _ = first
    runs_before = query(ws, "SELECT count(*) FROM runs")[0][0]
    dirs_before = set(os.listdir(ws / "runs"))
    a_err = open(tmp_path / "first.err", "w+")
    a = popen("run", *TINY, "rl.steps=40", ws=ws, stdout=subprocess.DEVNULL, stderr=a_err)
    try:
        deadline = time.monotonic() + 120
        while not workspace_busy(Workspace.at(ws)):
            assert a.poll() is None and time.monotonic() < deadline, "the first run never took the workspace"
            time.sleep(0.1)
        t0 = time.monotonic()
        b = laminar("run", *TINY, ws=ws, check=False, timeout=120)
        took = time.monotonic() - t0
        assert b.returncode == 3, (b.returncode, b.stderr[-2000:])
        assert "is in use by another laminar process" in b.stderr and f"pid {a.pid}" in b.stderr
        assert a.poll() is None, "the second run waited for the first instead of failing at once"
        assert took < 60
        a.wait(timeout=600)
        assert a.returncode == 0, (tmp_path / "first.err").read_text()[-3000:]
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
        a_err.close()
    assert query(ws, "SELECT count(*) FROM runs")[0][0] == runs_before + 1  # the first run's row only
    new = set(os.listdir(ws / "runs")) - dirs_before
    assert len(new) == 1 and query(ws, "SELECT status FROM runs WHERE run_id = ?", [new.pop()]) == [
        ("completed",)
    ]


def _artifact_folders_complete(ws: Path, tmp_clean: bool) -> None:
    """Every published artifact has its manifest; ``tmp_clean``: no writer's folder is left in ``.tmp``."""
    for kind in (ws / "artifacts").iterdir():
        if kind.name != ".tmp":
            assert all((d / "manifest.json").exists() for d in kind.iterdir()), kind
    tmp = ws / "artifacts" / ".tmp"
    if tmp_clean:
        assert not tmp.exists() or not list(tmp.iterdir())


@pytest.mark.slow
def test_sigkill_mid_stage_then_rerun_completes_from_finished_stages(first):
    ws, _ = first
    args = [*TINY, "rl.steps=200"]
    proc = popen("run", *args, ws=ws, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    started = threading.Event()

    def watch() -> None:  # the RL stage prints one line per step
        seen = b""
        while chunk := os.read(proc.stdout.fileno(), 4096):
            seen = (seen + chunk)[-4096:]
            if re.search(rb"step +1/200", seen):
                started.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert started.wait(timeout=300), "RL never started"
        assert proc.poll() is None, "the run finished before it could be killed; raise rl.steps"
        os.kill(proc.pid, signal.SIGKILL)  # the CLI process only, as the OOM killer would
        proc.wait()
        killed = query(ws, "SELECT run_id, status FROM runs ORDER BY started_at DESC LIMIT 1")[0]
        assert killed[1] == "running"
        finished = {r[0] for r in query(ws, "SELECT stage FROM stage_runs WHERE run_id = ?", [killed[0]])}
        assert "rl" not in finished and finished  # killed in RL, after the stages before it
        _artifact_folders_complete(ws, tmp_clean=False)  # the killed writer's folder is unpublished

        out = laminar("run", *args, ws=ws)
        assert f"run {killed[0]} never finished" in out.stderr
        s = latest_summary(ws)
        st = statuses(s)
        assert {k for k, v in st.items() if v == "cached"} == finished
        assert {k for k, v in st.items() if v == "ran"} == set(NAMES) - finished
        assert query(ws, "SELECT status FROM runs WHERE run_id = ?", [killed[0]]) == [("interrupted",)]
        # no duplicate rows: one stage row per (run, stage), the killed RL attempt counted nowhere
        assert query(ws, "SELECT count(*) FROM stage_runs WHERE run_id = ?", [s["run_id"]]) == [(len(NAMES),)]
        assert query(
            ws, "SELECT count(*), count(DISTINCT stage) FROM stage_runs WHERE run_id = ?", [killed[0]]
        ) == [(len(finished), len(finished))]
        rl_sha = s["stages"]["rl"]["artifacts"]["model"]
        assert query(
            ws, "SELECT sum(n_trajectories) FROM consumed_prompts WHERE checkpoint_sha = ?", [rl_sha]
        ) == [(s["stages"]["rl"]["metrics"]["trajectories"],)]
        assert query(ws, "SELECT count(*) FROM checkpoints WHERE checkpoint_sha = ?", [rl_sha]) == [(1,)]
        steps = query(
            ws,
            "SELECT count(DISTINCT step), max(step) FROM metrics WHERE cache_key = ? AND name = 'reward'",
            [s["stages"]["rl"]["cache_key"]],
        )
        assert steps == [(200, 200)]
        _artifact_folders_complete(ws, tmp_clean=True)
        assert orphan_prefect_servers(Workspace.at(ws)) == []  # the killed run's Prefect server was stopped
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- source code -------------------------------------------------------------------------------------------


@pytest.mark.slow  # the CLI path; in process: tests/tasks/test_lineage.py (make test)
def test_an_edited_source_file_reruns_exactly_the_downstream_stages(first, tmp_path):
    """Through the real CLI, with the module-source lookup pointed at an edited copy of the sources
    (the repository's files are never touched)."""
    ws, _ = first
    stage = middle_stage()
    module = own_module(next(s for s in STAGES if s.name == stage))
    copy = tmp_path / "src"
    for pkg in cache.PROJECT_PACKAGES:  # the sources and the code data files they fingerprint
        for f in (ROOT / pkg).rglob("*"):
            if f.suffix != ".py" and f.suffix not in cache.CODE_DATA_SUFFIXES:
                continue
            (copy / f.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, copy / f.relative_to(ROOT))
    edited = copy / Path(*module.split(".")).with_suffix(".py")
    if not edited.exists():
        edited = copy / Path(*module.split(".")) / "__init__.py"
    edited.write_text(edited.read_text() + "\n# an edit\n")
    direct = {
        s.name
        for s in stages_of()
        if module in {m for m, _ in cache.module_closure(tuple(sorted(s.modules)))}
    }
    code = (
        "import sys; from pathlib import Path; import tasks.cache as c; c.ROOT = Path(sys.argv[1]); "
        "from flows.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(copy), "run", *TINY, "--workspace", str(ws)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = latest_summary(ws)
    st = statuses(after)
    ran = {k for k, v in st.items() if v == "ran"}
    # every stage whose code reaches the edit reruns; nothing outside their downstream does
    assert direct <= ran <= downstream_of(direct)
    assert {k for k, v in st.items() if v == "cached"} >= set(NAMES) - downstream_of(direct)
    # in between, content addressing decides: a stage reruns exactly when an input's content changed
    before = first[1]["stages"]
    for stage_ in STAGES:
        if stage_.name in downstream_of(direct) - direct:
            inputs_changed = any(
                after["stages"][src]["artifacts"][out] != before[src]["artifacts"][out]
                for src, out in active_inputs(stage_, DEFAULT_CONFIG).values()
            )
            assert (st[stage_.name] == "ran") == inputs_changed, stage_.name
    laminar("run", *TINY, ws=ws)  # the unedited sources are still served from cache
    assert set(statuses(latest_summary(ws)).values()) == {"cached"}


# ---- serve -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_registers_the_cron_schedule_and_a_triggered_run_completes(first):
    ws, _ = first
    cron = "0 0 1 1 *"  # never fires during the test: the run is triggered
    proc = popen(
        "serve",
        "--cron",
        cron,
        "--port",
        "0",
        *TINY,
        "rl.steps=3",
        ws=ws,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
    try:
        deadline = time.monotonic() + 240
        deployments: list = []
        client = None
        while not deployments:
            assert proc.poll() is None, "".join(lines)[-3000:]
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(1)
            if api:  # the API asks for the workspace's auth string (and a CSRF token to change anything)
                client = client or ServedAPI(api[0], ws)
                deployments = client.call("/deployments/filter", {})
        assert (ws / "prefect" / "server.json").exists()  # the server runs with the workspace's Prefect home
        (dep,) = deployments
        assert dep["name"] == f"laminar-{ws.name}" and dep["schedules"][0]["schedule"]["cron"] == cron
        assert dep["parameters"]["workspace"] == str(ws) and "rl.steps=3" in dep["parameters"]["overrides"]

        flow_run = client.call(f"/deployments/{dep['id']}/create_flow_run", {})
        deadline = time.monotonic() + 400
        while True:
            state = client.call(f"/flow_runs/{flow_run['id']}", method="GET")["state"]
            if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(1)
        assert state["type"] == "COMPLETED", "".join(lines)[-3000:]

        (run,) = query(ws, "SELECT run_id, status FROM runs WHERE prefect_flow_run_id = ?", [flow_run["id"]])
        assert run[1] == "completed"
        s = summaries(ws)[run[0]]
        assert statuses(s)["rl"] == "ran" and set(s["stages"]) == set(NAMES)

        keys = {a["key"] for a in client.call("/artifacts/filter", {})}
        assert {artifact_key(n) for n in NAMES} | {artifact_key(n, "lineage") for n in NAMES} <= keys
        wanted = asset_key(Workspace.at(ws), "rl", "model")
        deadline = time.monotonic() + 60
        while True:  # events reach the API in the background
            events = client.call(
                "/events/filter", {"filter": {"event": {"prefix": ["prefect.asset."]}}, "limit": 50}
            )
            mats = [
                e
                for e in events["events"]
                if e["event"] == "prefect.asset.materialization.succeeded"
                and e["resource"]["prefect.resource.id"] == wanted
            ]
            if mats or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert mats and mats[0]["payload"]["sha256"] == s["stages"]["rl"]["artifacts"]["model"]
        upstream = {asset_key(Workspace.at(ws), src, out) for src, out in STAGE_BY_NAME["rl"].inputs.values()}
        assert upstream == {
            r["prefect.resource.id"] for r in mats[0]["related"] if r["prefect.resource.role"] == "asset"
        }
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # stops the runner, pauses the schedule, stops the server
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert not (ws / "prefect" / "server.json").exists()
