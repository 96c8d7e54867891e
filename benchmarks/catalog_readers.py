"""Catalog readers against a running pipeline: DuckDB lets one process write the catalog file and
refuses it to everyone else at that moment (no waiting), so ``core.catalog.Catalog`` retries the open
with a bounded, jittered backoff on both sides. This measures that choice.

* ``micro``: the cost of the retry path when no other process holds the catalog (``Catalog``'s
  connection vs a plain ``duckdb.connect``), how long a write waits behind another process that
  holds a read-only connection for N ms, and a read behind a write held N ms: the time from the
  holder's close to the waiter's open is the backoff's reaction latency.
* ``run``: a whole ``laminar run`` (default config unless overrides are given) while two reader
  processes poll the catalog: ``laminar status`` 200 ms after each one ends (the CLI's ``main`` in
  the reader process, and the real command in a subprocess every ``--cli-every`` seconds), and a raw
  ``duckdb.connect(path, read_only=True)`` counting every table's rows every 200 ms; then the
  same run without the reader in another workspace. Checks: both runs complete, every stage has
  its ``stage_runs`` row and the ``runs`` row says completed, the row counts per table match, and
  ``laminar status`` never printed a traceback.

    .venv/bin/python benchmarks/catalog_readers.py micro
    .venv/bin/python benchmarks/catalog_readers.py run [overrides...]      # ~2 default runs
    .venv/bin/python benchmarks/catalog_readers.py all

Writes ``benchmarks/results/catalog_readers_<UTC date>.json`` (or ``--json-out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HOLDER = textwrap.dedent("""
    import sys, time, duckdb
    mode, hold = sys.argv[2], float(sys.argv[3])
    con = duckdb.connect(sys.argv[1], read_only=mode == "ro")
    print("open", time.monotonic(), flush=True)
    time.sleep(hold)
    con.close()
    print("closed", time.monotonic(), flush=True)
""")


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    return env


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs),
        "median": statistics.median(xs),
        "min": xs[0],
        "max": xs[-1],
        "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
    }


# ---- micro ------------------------------------------------------------------------------------------


def micro(repeats: int = 5, iterations: int = 200) -> dict:
    import duckdb

    from core.catalog import SCHEMA, Catalog

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cat = Catalog(Path(tmp) / "catalog.duckdb")
        with cat.transaction():
            pass

        # 1. no other process: the retry path's overhead
        def plain_write():
            con = duckdb.connect(str(cat.path))
            con.execute(SCHEMA)
            con.execute("BEGIN TRANSACTION")
            con.execute("COMMIT")
            con.close()

        def catalog_write():
            with cat.transaction():
                pass

        def plain_read():
            con = duckdb.connect(str(cat.path), read_only=True)
            con.execute("SELECT count(*) FROM runs").fetchall()
            con.close()

        def catalog_read():
            cat.query("SELECT count(*) FROM runs")

        fns = {
            "plain_write": plain_write,
            "catalog_write": catalog_write,
            "plain_read": plain_read,
            "catalog_read": catalog_read,
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(iterations + 10):  # interleaved, so the machine's load drifts alike for all four
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                if i >= 10:  # warm-up
                    times[name].append((time.perf_counter() - t0) * 1e3)
        out["no_other_process_ms"] = {name: _stats(ts) for name, ts in times.items()}
        ms = out["no_other_process_ms"]
        out["retry_path_overhead_ms"] = {
            "write": ms["catalog_write"]["median"] - ms["plain_write"]["median"],
            "read": ms["catalog_read"]["median"] - ms["plain_read"]["median"],
        }
        print(
            f"no other process: write {ms['plain_write']['median']:.2f} ms plain vs "
            f"{ms['catalog_write']['median']:.2f} ms Catalog; read {ms['plain_read']['median']:.2f} vs "
            f"{ms['catalog_read']['median']:.2f} ms",
            flush=True,
        )

        # 2. a waiter behind another process holding its connection for N ms
        for side, holder_mode in (("writer_behind_reader", "ro"), ("reader_behind_writer", "rw")):
            rows = []
            for hold_ms in (10, 50, 200, 1000, 3000):
                waits, latencies = [], []
                for _ in range(repeats):
                    proc = subprocess.Popen(
                        [sys.executable, "-c", HOLDER, str(cat.path), holder_mode, str(hold_ms / 1e3)],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    word, t_open = proc.stdout.readline().split()
                    assert word == "open"
                    t0 = time.monotonic()
                    if side == "writer_behind_reader":
                        with cat.connect():
                            t1 = time.monotonic()
                    else:
                        with cat.connect(read_only=True):
                            t1 = time.monotonic()
                    word, t_closed = proc.stdout.readline().split()
                    proc.wait()
                    waits.append((t1 - t0) * 1e3)
                    latencies.append((t1 - float(t_closed)) * 1e3)
                rows.append(
                    {"hold_ms": hold_ms, "wait_ms": _stats(waits), "after_close_ms": _stats(latencies)}
                )
                print(
                    f"{side}: holder keeps its connection {hold_ms} ms after we start: waited "
                    f"{statistics.median(waits):.0f} ms (median of {repeats}), opened "
                    f"{statistics.median(latencies):.1f} ms after the holder closed "
                    f"(max {max(latencies):.1f})",
                    flush=True,
                )
            out[side] = rows
    return out


# ---- a run with readers -------------------------------------------------------------------------------


def status_loop(ws: Path, poll_s: float, stop: Path, out: Path, cli_every_s: float) -> None:
    """``laminar status`` every ``poll_s`` after the previous one ends (through the CLI's ``main`` in
    this process; the real command in a subprocess every ``cli_every_s``), until ``stop`` exists."""
    from flows.cli import main as laminar_main

    status = {
        "polls": 0,
        "ok": 0,
        "failures": 0,
        "tracebacks": 0,
        "outputs_with_traceback": 0,
        "seconds": [],
        "first_failure": None,
    }
    cli = {"runs": 0, "ok": 0, "tracebacks": 0, "failures": [], "seconds": []}
    pending = None
    next_cli = time.monotonic() + cli_every_s
    while not stop.exists():
        buf_out, buf_err = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
                rc = laminar_main(["status", "--workspace", str(ws)])
        except BaseException as err:  # what a user would see as a traceback
            rc = None
            status["tracebacks"] += 1
            status["first_failure"] = (
                status["first_failure"] or "".join(traceback.format_exception(err))[-2000:]
            )
        status["seconds"].append(time.perf_counter() - t0)
        status["polls"] += 1
        if "Traceback" in buf_out.getvalue() + buf_err.getvalue():
            status["outputs_with_traceback"] += 1
        if rc == 0:
            status["ok"] += 1
        elif rc is not None:
            status["failures"] += 1
            status["first_failure"] = status["first_failure"] or buf_err.getvalue()[-2000:]
        if pending is not None and pending[0].poll() is not None:
            proc, t_start = pending
            err_text = proc.stderr.read()
            cli["runs"] += 1
            cli["seconds"].append(time.monotonic() - t_start)
            cli["ok"] += proc.returncode == 0
            cli["tracebacks"] += "Traceback" in err_text
            if proc.returncode != 0:
                cli["failures"].append(err_text[-500:])
            pending = None
        if pending is None and time.monotonic() >= next_cli:
            pending = (
                subprocess.Popen(
                    [*_laminar_cmd(), "status", "--workspace", str(ws)],
                    cwd=ROOT,
                    env=_env(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
                time.monotonic(),
            )
            next_cli = time.monotonic() + cli_every_s
        time.sleep(poll_s)
    if pending is not None:
        pending[0].wait()
    for d in (status, cli):
        d["seconds"] = _stats(d["seconds"]) if d["seconds"] else None
    out.write_text(json.dumps({"status_reader": status, "cli_status": cli}, indent=2))


def raw_loop(ws: Path, poll_s: float, stop: Path, out: Path) -> None:
    """A raw ``duckdb.connect(path, read_only=True)`` counting every table's rows, every ``poll_s``, as
    a notebook would (no retry: a lock conflict or any other error is counted)."""
    import duckdb

    catalog = ws / "catalog.duckdb"
    raw = {
        "polls": 0,
        "ok": 0,
        "lock_conflicts": 0,
        "other_errors": 0,
        "first_error": None,
        "seconds": [],
        "max_rows_seen": 0,
    }
    next_t = time.monotonic()
    while not stop.exists():
        t0 = time.perf_counter()
        try:
            if catalog.exists():
                con = duckdb.connect(str(catalog), read_only=True)
                try:
                    tables = [
                        r[0]
                        for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
                    ]
                    rows = sum(con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables)
                    raw["max_rows_seen"] = max(raw["max_rows_seen"], rows)
                finally:
                    con.close()
            raw["ok"] += 1
        except duckdb.IOException as err:
            if "could not set lock" in str(err).lower():
                raw["lock_conflicts"] += 1
            else:
                raw["other_errors"] += 1
                raw["first_error"] = raw["first_error"] or str(err)
        except Exception as err:  # any other failure is counted; the poll goes on
            raw["other_errors"] += 1
            raw["first_error"] = raw["first_error"] or f"{type(err).__name__}: {err}"
        raw["seconds"].append(time.perf_counter() - t0)
        raw["polls"] += 1
        next_t += poll_s
        time.sleep(max(0.0, next_t - time.monotonic()))
    raw["seconds"] = _stats(raw["seconds"]) if raw["seconds"] else None
    out.write_text(json.dumps({"raw_reader": raw}, indent=2))


def _laminar_cmd() -> list[str]:
    script = Path(sys.executable).parent / "laminar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "flows.cli"]


def catalog_facts(ws: Path, overrides: list[str]) -> dict:
    """Row counts per table, the latest run's row and the stages active under ``overrides`` that have
    no row in it (a stage its config turns off, such as the reward model's, never writes one)."""
    from conf.loader import load_config
    from core.catalog import Catalog
    from tasks.dag import STAGES

    cat = Catalog(ws / "catalog.duckdb")
    tables = [
        r["table_name"]
        for r in cat.query("SELECT table_name FROM information_schema.tables ORDER BY table_name")
    ]
    counts = {t: cat.query(f'SELECT count(*) AS n FROM "{t}"')[0]["n"] for t in tables}
    run = cat.query("SELECT run_id, status FROM runs ORDER BY started_at DESC LIMIT 1")
    stages = (
        {r["stage"] for r in cat.query("SELECT stage FROM stage_runs WHERE run_id = ?", [run[0]["run_id"]])}
        if run
        else set()
    )
    return {
        "counts": counts,
        "run_id": run[0]["run_id"] if run else None,
        "run_row": run[0]["status"] if run else None,
        "missing_stage_rows": [
            s.name for s in STAGES if s.active(load_config(overrides)) and s.name not in stages
        ],
    }


def writer_waits(ws: Path, run_id: str | None) -> dict:
    """The run's own catalog waits, from its log (``core.catalog`` logs every writer wait)."""
    log = ws / "logs" / f"{run_id}.log"
    waits = (
        [float(m.group(1)) for m in re.finditer(r"writer waited ([0-9.]+) s", log.read_text())]
        if run_id and log.exists()
        else []
    )
    return {"count": len(waits), "total_s": sum(waits), "max_s": max(waits, default=0.0)}


def run_with_readers(
    ws: Path,
    overrides: list[str],
    poll_s: float = 0.2,
    timeout_s: float = 1800,
    readers: bool = True,
    cli_every_s: float = 15.0,
) -> dict:
    ws = Path(ws)
    ws.mkdir(parents=True, exist_ok=True)
    stop = ws.parent / f".{ws.name}.stop"
    tallies = [ws.parent / f".{ws.name}.{kind}.json" for kind in ("status", "raw")]
    stop.unlink(missing_ok=True)
    procs = []
    if readers:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "_status",
                    str(ws),
                    str(poll_s),
                    str(stop),
                    str(tallies[0]),
                    str(cli_every_s),
                ],
                cwd=ROOT,
                env=_env(),
            ),
            subprocess.Popen(
                [sys.executable, __file__, "_raw", str(ws), str(poll_s), str(stop), str(tallies[1])],
                cwd=ROOT,
                env=_env(),
            ),
        ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [*_laminar_cmd(), "run", *overrides, "--workspace", str(ws)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        stop.touch()
        for reader in procs:
            reader.wait(timeout=300)
    seconds = time.perf_counter() - t0
    facts = catalog_facts(ws, overrides)
    res = {
        "overrides": overrides,
        "run": {
            "returncode": proc.returncode,
            "seconds": seconds,
            "stderr_tail": proc.stderr[-3000:],
            "stderr_has_traceback": "Traceback" in proc.stderr,
        },
        **facts,
        "writer_waits": writer_waits(ws, facts["run_id"]),
    }
    for path in tallies if readers else []:
        res.update(json.loads(path.read_text()))
        path.unlink()
    stop.unlink(missing_ok=True)
    return res


def full(overrides: list[str], poll_s: float, cli_every_s: float, keep: bool) -> dict:
    base = Path(tempfile.mkdtemp(prefix="catalog-readers-"))
    try:
        print(f"run with readers polling every {poll_s * 1e3:.0f} ms in {base / 'with'} ...", flush=True)
        with_r = run_with_readers(base / "with", overrides, poll_s=poll_s, cli_every_s=cli_every_s)
        print(_summary_line("with readers", with_r), flush=True)
        print(f"the same run without readers in {base / 'without'} ...", flush=True)
        without = run_with_readers(base / "without", overrides, readers=False)
        print(_summary_line("without readers", without), flush=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    differ = {
        t: (with_r["counts"].get(t), without["counts"].get(t))
        for t in sorted(set(with_r["counts"]) | set(without["counts"]))
        if with_r["counts"].get(t) != without["counts"].get(t)
    }
    ok = (
        with_r["run"]["returncode"] == 0
        and with_r["run_row"] == "completed"
        and not with_r["missing_stage_rows"]
        and with_r["status_reader"]["tracebacks"] == 0
        and with_r["status_reader"]["outputs_with_traceback"] == 0
        and with_r["status_reader"]["failures"] == 0
        and with_r["cli_status"]["tracebacks"] == 0
        and not differ
    )
    return {"with_readers": with_r, "without_readers": without, "row_counts_differ": differ, "ok": ok}


def _summary_line(label: str, r: dict) -> str:
    line = (
        f"{label}: rc {r['run']['returncode']} in {r['run']['seconds']:.0f} s, run row {r['run_row']}, "
        f"missing stage rows {r['missing_stage_rows'] or 'none'}, {sum(r['counts'].values())} rows; "
        f"run's catalog waits {r['writer_waits']['count']} (total {r['writer_waits']['total_s']:.2f} s, "
        f"max {r['writer_waits']['max_s']:.2f} s)"
    )
    if "status_reader" in r:
        s, w, c = r["status_reader"], r["raw_reader"], r["cli_status"]
        line += (
            f"; status polls {s['polls']} ok {s['ok']} tracebacks {s['tracebacks']}; raw polls {w['polls']} "
            f"ok {w['ok']} lock conflicts {w['lock_conflicts']}; CLI status {c['runs']} ok {c['ok']} "
            f"tracebacks {c['tracebacks']}"
        )
    return line


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_status":
        ws, poll_s, stop, out, cli_every_s = sys.argv[2:7]
        status_loop(Path(ws), float(poll_s), Path(stop), Path(out), float(cli_every_s))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_raw":
        ws, poll_s, stop, out = sys.argv[2:6]
        raw_loop(Path(ws), float(poll_s), Path(stop), Path(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("micro", "run", "all"))
    ap.add_argument("--poll-ms", type=float, default=200.0)
    ap.add_argument(
        "--cli-every", type=float, default=15.0, help="seconds between real `laminar status` commands"
    )
    ap.add_argument("--keep", action="store_true", help="keep the two workspaces")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    result: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "command": " ".join(sys.argv),
    }
    if args.what in ("micro", "all"):
        result["micro"] = micro()
    if args.what in ("run", "all"):
        result["run"] = full(args.overrides, args.poll_ms / 1e3, args.cli_every, args.keep)
        print("OK" if result["run"]["ok"] else "NOT OK", flush=True)
    out = (
        args.json_out
        or ROOT / "benchmarks" / "results" / f"catalog_readers_{datetime.now(UTC).strftime('%Y-%m-%d')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
