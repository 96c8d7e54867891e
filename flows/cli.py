"""The ``laminar`` command. Parses arguments and validates the config before anything heavy is
imported or any file is written; then hands over to the flow."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import uuid
from datetime import datetime, timezone


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar", description="Curation, RL training and evaluation as one cached DAG.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("run", "run the pipeline (cached stages are skipped)"),
                       ("status", "each stage cached or stale for the current config, and why"),
                       ("config", "print the resolved config"),
                       ("eval", "evaluate one checkpoint: ckpt=<sha prefix or save_pretrained folder> [overrides]"),
                       ("report", "write report.md and plots for a run (default: the latest completed run)")):
        sp = sub.add_parser(name, help=text)
        if name == "report":
            sp.add_argument("run_id", nargs="?", default=None, help="run id (default: the latest completed run)")
        else:
            sp.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option"
                            + ("; ckpt=<checkpoint sha prefix or folder> is required" if name == "eval" else ""))
        sp.add_argument("--workspace", default=os.environ.get("LAMINAR_WORKSPACE", "./workspace"),
                        help="workspace folder (default ./workspace)")
        if name == "run":
            sp.add_argument("--force", action="append", default=[], metavar="STAGE",
                            help="rerun STAGE even if cached (repeatable)")
    return p


def _load(overrides, preflight: bool = False):
    from conf.loader import load_config
    from conf.schema import ConfigError

    try:
        cfg = load_config(overrides)
        if preflight:
            from tasks.preflight import preflight as check

            check(cfg)
        return cfg
    except ConfigError as err:
        print(f"laminar: config error: {err}", file=sys.stderr)
        raise SystemExit(2)


def cmd_config(args) -> int:
    from conf.loader import to_yaml

    print(to_yaml(_load(args.overrides)), end="")
    return 0


def cmd_status(args) -> int:
    from core.workspace import Workspace
    from tasks.runner import plan

    cfg = _load(args.overrides)
    for p in plan(cfg, Workspace.at(args.workspace)):
        print(f"{p.stage:<12} {p.status:<7} {p.reason}")
    return 0


def cmd_run(args) -> int:
    from core.workspace import Workspace, WorkspaceBusy
    from tasks.prefect_env import configure_prefect
    from tasks.stages import STAGE_BY_NAME

    cfg = _load(args.overrides, preflight=True)
    unknown = [s for s in args.force if s not in STAGE_BY_NAME]
    if unknown:
        print(f"laminar: unknown stage {unknown}; stages are {', '.join(STAGE_BY_NAME)}", file=sys.stderr)
        return 2
    ws = Workspace.at(args.workspace)
    try:
        with ws.lock():
            ws.create()
            ws.artifacts.clean_tmp()
            configure_prefect(ws)
            run_id, command = _new_run_id(), _command()
            ws.run_dir(run_id).mkdir(parents=True)
            _save_run_files(ws, run_id, cfg, command)
            return _run(cfg, ws, run_id, args, command)
    except WorkspaceBusy as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 3


def _run(cfg, ws, run_id, args, command) -> int:
    import logging

    from core.artifacts import write_json_atomic
    from core.catalog import dumps
    from conf.loader import to_dict

    logging.getLogger("transformers").setLevel(logging.ERROR)
    handler = logging.FileHandler(ws.logs / f"{run_id}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    laminar_log = logging.getLogger("laminar")
    laminar_log.setLevel(logging.INFO)
    laminar_log.addHandler(handler)
    laminar_log.propagate = False
    t0 = time.perf_counter()
    with ws.catalog.transaction() as con:
        con.execute("INSERT INTO runs VALUES (?, now(), NULL, 'running', ?, ?, NULL)",
                    [run_id, command, dumps(to_dict(cfg))])
    from flows.pipeline import laminar_pipeline
    from tasks.summary import build_summary, format_table

    status = "failed"
    try:
        outcomes = laminar_pipeline(overrides=list(args.overrides), workspace=str(ws.root), run_id=run_id,
                                    force=list(args.force))
        summary = build_summary(run_id, outcomes, time.perf_counter() - t0)
        write_json_atomic(ws.run_dir(run_id) / "summary.json", summary)
        print(format_table(summary))
        print(f"summary: {ws.run_dir(run_id) / 'summary.json'}")
        status = "completed"
        return 0
    finally:
        with ws.catalog.transaction() as con:
            con.execute("UPDATE runs SET finished_at = now(), status = ? WHERE run_id = ?", [status, run_id])


def _split_ckpt(overrides: list[str]) -> tuple[str, list[str]]:
    """``ckpt=...`` is not a config key: take it out of the overrides before composing the config."""
    ckpts = [o.split("=", 1)[1] for o in overrides if o.startswith("ckpt=")]
    if len(ckpts) != 1 or not ckpts[0]:
        print("laminar: eval needs exactly one ckpt=<checkpoint sha prefix or save_pretrained folder>, e.g. "
              "`laminar eval ckpt=3f2a9c eval.benchmarks=[arith_heldout]` (a run's summary.json lists its checkpoints)",
              file=sys.stderr)
        raise SystemExit(2)
    return ckpts[0], [o for o in overrides if not o.startswith("ckpt=")]


def cmd_eval(args) -> int:
    from core.workspace import Workspace, WorkspaceBusy
    from tasks.checkpoint_eval import EvalInputError, evaluate, format_eval

    ckpt, overrides = _split_ckpt(args.overrides)
    cfg = _load(overrides, preflight=True)
    ws = Workspace.at(args.workspace)
    try:
        with ws.lock():
            ws.create()
            ws.artifacts.clean_tmp()
            run_id, command = _new_run_id("eval-"), _command()
            _quiet_transformers()
            try:
                report = evaluate(cfg, ws, ckpt, run_id, command)
            except EvalInputError as err:
                print(f"laminar: {err}", file=sys.stderr)
                return 2
            _save_run_files(ws, run_id, cfg, command)
    except WorkspaceBusy as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 3
    print(format_eval(report))
    print(f"summary: {ws.run_dir(run_id) / 'summary.json'}")
    return 0


def cmd_report(args) -> int:
    from core.workspace import Workspace
    from tasks.report import ReportError, write

    ws = Workspace.at(args.workspace)
    if not ws.catalog.path.exists():
        print(f"laminar: no catalog in {ws.root}; pass --workspace DIR of a workspace `laminar run` used",
              file=sys.stderr)
        return 2
    try:
        path = write(ws, args.run_id)
    except ReportError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _new_run_id(prefix: str = "") -> str:
    return prefix + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _command() -> str:
    return shlex.join(["laminar", *sys.argv[1:]])


def _save_run_files(ws, run_id: str, cfg, command: str) -> None:
    """The resolved config and the exact command beside the run's outputs."""
    from conf.loader import to_yaml

    run_dir = ws.run_dir(run_id)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "command.txt").write_text(command + "\n")


def _quiet_transformers() -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)


COMMANDS = {"run": cmd_run, "status": cmd_status, "config": cmd_config, "eval": cmd_eval, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return COMMANDS[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
