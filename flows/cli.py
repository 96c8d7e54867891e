"""The ``laminar`` command. Parses arguments and validates the config before anything heavy is
imported or any file is written; then hands over to the flow."""

from __future__ import annotations

import argparse
import os
import sys


def _workspace_arg(sp) -> None:
    sp.add_argument(
        "--workspace",
        default=os.environ.get("LAMINAR_WORKSPACE", "./workspace"),
        help="workspace folder (default ./workspace, or $LAMINAR_WORKSPACE)",
    )


def _overrides_arg(sp, extra: str = "") -> None:
    sp.add_argument("overrides", nargs="*", help="Hydra overrides: key=value, group=option" + extra)


def _allow_empty_arg(sp) -> None:
    sp.add_argument(
        "--allow-empty",
        action="store_true",
        help="go on when the prompt pool is empty or ingest keeps none of its rows (data.allow_empty=true)",
    )


def _with_flags(args) -> list[str]:
    """The overrides, plus what the command's flags set in the config."""
    return list(args.overrides) + (["data.allow_empty=true"] if getattr(args, "allow_empty", False) else [])


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    p = argparse.ArgumentParser(
        prog="laminar",
        description="Curation, RL training and evaluation as one cached DAG.",
        epilog="Global options such as --workspace DIR go before or after the subcommand.",
    )
    _workspace_arg(p)
    sub = p.add_subparsers(dest="command", required=True)

    _pipeline_commands(sub)
    _checkpoint_commands(sub)
    _serve_policy_command(sub)
    _workspace_commands(sub)
    return p, dict(sub.choices)


def _pipeline_commands(sub: argparse._SubParsersAction) -> None:
    """run, rerun, status, config."""
    sp = sub.add_parser("run", help="run the pipeline (cached stages are skipped)")
    _overrides_arg(sp)
    sp.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STAGE",
        help="rerun STAGE even if cached (repeatable)",
    )
    sp.add_argument("--until", metavar="STAGE", help="run only STAGE and the stages it needs")
    _allow_empty_arg(sp)
    _workspace_arg(sp)

    sp = sub.add_parser(
        "rerun", help="rerun STAGE and everything downstream of it; its upstream comes from cache"
    )
    sp.add_argument("stage", help="the stage to rerun")
    _overrides_arg(sp)
    _allow_empty_arg(sp)
    _workspace_arg(sp)

    sp = sub.add_parser("status", help="each stage cached or stale for the current config, and why")
    _overrides_arg(sp)
    _workspace_arg(sp)

    sp = sub.add_parser("config", help="print the resolved config")
    _overrides_arg(sp)
    _workspace_arg(sp)

    sp = sub.add_parser("model", help="fetch a real pretrained model into the workspace: model fetch smollm2")
    sp.add_argument("action", choices=("fetch",), help="fetch: install, check and convert it once")
    sp.add_argument("name", help="the model (smollm2); model=NAME then uses it")
    _workspace_arg(sp)


def _checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    """eval, export, report, runs, lineage."""
    sp = sub.add_parser(
        "eval", help="evaluate one checkpoint: ckpt=<sha prefix or save_pretrained folder> [overrides]"
    )
    _overrides_arg(sp, "; ckpt=<checkpoint sha prefix or folder> is required")
    _workspace_arg(sp)

    sp = sub.add_parser(
        "export",
        help="write a checkpoint (a LoRA adapter merged into its base) as one "
        "save_pretrained folder: ckpt=<sha prefix or folder> out=<new folder>",
    )
    sp.add_argument(
        "items", nargs="+", metavar="KEY=VALUE", help="ckpt=<sha prefix or folder> out=<new folder>"
    )
    _workspace_arg(sp)

    sp = sub.add_parser(
        "report", help="write report.md and plots for a run (default: the latest completed run)"
    )
    sp.add_argument("run_id", nargs="?", default=None, help="run id (default: the latest completed run)")
    _workspace_arg(sp)

    sp = sub.add_parser("runs", help="runs and checkpoints with their headline metrics")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.add_argument("--limit", type=int, default=None, help="only the N latest runs")
    _workspace_arg(sp)

    sp = sub.add_parser(
        "lineage", help="a checkpoint's upstream tree down to its sources, prompts and evaluations"
    )
    sp.add_argument(
        "checkpoint", help="a checkpoint (or any artifact) sha prefix, or a save_pretrained folder"
    )
    sp.add_argument("--json", action="store_true", help="print JSON (same as --format json)")
    sp.add_argument(
        "--format",
        choices=("text", "json", "openlineage"),
        default=None,
        help="openlineage: one OpenLineage run event (JSON) per stage, one per line",
    )
    sp.add_argument(
        "--prompts", action="store_true", help="every prompt id the checkpoint trained on, and how often"
    )
    _workspace_arg(sp)


def _serve_policy_command(sub: argparse._SubParsersAction) -> None:
    sp = sub.add_parser(
        "serve-policy", help="the OpenAI-compatible agent endpoint over a checkpoint, outside training"
    )
    sp.add_argument(
        "checkpoint", help="a save_pretrained (or LoRA adapter) folder, or a checkpoint sha prefix"
    )
    sp.add_argument("--port", type=int, default=0, help="loopback port (default 0: a free one)")
    sp.add_argument("--max-tokens", type=int, default=256, help="the longest completion (default 256)")
    sp.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    sp.add_argument(
        "--max-batch", type=int, default=32, help="the most rows (choices) decoding together (default 32)"
    )
    sp.add_argument("--seconds", type=float, default=None, help="stop after this long (default: Ctrl-C)")
    _workspace_arg(sp)


def cmd_serve_policy(args) -> int:
    from core.workspace import Workspace
    from tasks.checkpoint_eval import EvalInputError
    from tasks.serve_policy import serve_policy

    if args.max_tokens < 1 or args.max_batch < 1 or not 0 <= args.port <= 65535:
        print(
            "laminar: serve-policy needs --max-tokens >= 1, --max-batch >= 1 and --port in [0, 65535]",
            file=sys.stderr,
        )
        return 2
    _quiet_transformers()
    try:
        serve_policy(
            Workspace.at(args.workspace),
            args.checkpoint,
            port=args.port,
            max_tokens=args.max_tokens,
            seed=args.seed,
            seconds=args.seconds,
            max_batch=args.max_batch,
            say=lambda line: print(line, flush=True),
        )
    except EvalInputError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    return 0


def _workspace_commands(sub: argparse._SubParsersAction) -> None:
    """fsck, simulate, serve."""
    sp = sub.add_parser(
        "fsck", help="rehash every stored artifact and quarantine those whose files changed (exit 1 if any)"
    )
    _workspace_arg(sp)

    sp = sub.add_parser(
        "simulate", help="simulate RL modes at cluster scale (discrete-event, the real control plane)"
    )
    _overrides_arg(
        sp, " of conf/simulate.yaml, e.g. cluster.nodes=16 model.preset=qwen2.5-32b modes=[sync,laminar]"
    )
    _workspace_arg(sp)

    sp = sub.add_parser("serve", help="serve the pipeline as a Prefect deployment on a cron schedule")
    sp.add_argument("--cron", required=True, help="cron expression, e.g. '0 3 * * *' (every day at 03:00)")
    sp.add_argument("--name", default=None, help="deployment name (default: laminar-<workspace folder name>)")
    sp.add_argument(
        "--port",
        type=int,
        default=4200,
        help="port of the Prefect server started when PREFECT_API_URL is unset (default 4200; "
        "another free port when taken; 0: any free port)",
    )
    sp.add_argument("--force", action="append", default=[], metavar="STAGE", help="rerun STAGE in every run")
    sp.add_argument("--until", metavar="STAGE", help="run only STAGE and the stages it needs")
    _overrides_arg(sp)
    _workspace_arg(sp)


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
        raise SystemExit(2) from None


def _with_model(overrides: list[str], workspace: str) -> list[str]:
    """``overrides`` plus ``model.path=`` of a pretrained model the config names (fetched on first use)."""
    from core.workspace import Workspace
    from tasks.models import with_pretrained

    return with_pretrained(_load(overrides), overrides, Workspace.at(workspace), _progress)


def _progress(line: str) -> None:
    print(f"laminar: {line}", file=sys.stderr, flush=True)


def cmd_model(args) -> int:
    from core.workspace import Workspace
    from tasks.models import fetch_model

    ref = fetch_model(Workspace.at(args.workspace), args.name, _progress)
    print(ref.path)
    return 0


def cmd_config(args) -> int:
    from tasks.preflight import resolved_yaml

    print(resolved_yaml(_load(args.overrides)), end="")
    return 0


def cmd_status(args) -> int:
    from core.workspace import Workspace
    from tasks.plan import plan

    cfg = _load(_with_model(args.overrides, args.workspace), preflight=True)
    for p in plan(cfg, Workspace.at(args.workspace)):
        print(f"{p.stage:<12} {p.status:<7} {p.reason}")
    return 0


def _selection(**kw):
    from tasks.dag import UnknownStage, select

    try:
        return select(**kw)
    except UnknownStage as err:
        print(f"laminar: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _pipeline(**kwargs):
    """The Prefect flow, imported only once the workspace has configured Prefect; a run in which every
    stage comes from cache is recorded without it (``tasks.runner.replay_cached``)."""
    from conf.loader import load_config
    from core.workspace import Workspace
    from tasks.runner import replay_cached

    outcomes = replay_cached(
        load_config(kwargs["overrides"]),
        Workspace.at(kwargs["workspace"]),
        kwargs["run_id"],
        stages=kwargs.get("stages"),
        force=kwargs.get("force"),
    )
    if outcomes is not None:
        return outcomes
    from flows.pipeline import laminar_pipeline

    return laminar_pipeline(**kwargs)


def _execute(overrides: list[str], workspace: str, **selection_kw) -> int:
    """``selection_kw``: ``tasks.dag.select``'s ``until``/``force``/``rerun``, over the config's graph."""
    from core.workspace import Workspace, WorkspaceBusy
    from tasks.runner import command_line, run_pipeline

    overrides = _with_model(overrides, workspace)
    cfg = _load(overrides, preflight=True)
    selection = _selection(cfg=cfg, **selection_kw)
    try:
        run_pipeline(
            cfg,
            Workspace.at(workspace),
            _pipeline,
            overrides=overrides,
            selection=selection,
            command=command_line(),
        )
    except WorkspaceBusy as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 3
    return 0


def cmd_run(args) -> int:
    return _execute(_with_flags(args), args.workspace, until=args.until, force=args.force)


def cmd_rerun(args) -> int:
    return _execute(_with_flags(args), args.workspace, rerun=args.stage)


def _split_ckpt(overrides: list[str]) -> tuple[str, list[str]]:
    """``ckpt=...`` is not a config key: take it out of the overrides before composing the config."""
    ckpts = [o.split("=", 1)[1] for o in overrides if o.startswith("ckpt=")]
    if len(ckpts) != 1 or not ckpts[0]:
        print(
            "laminar: eval needs exactly one ckpt=<checkpoint sha prefix or save_pretrained folder>, e.g. "
            "`laminar eval ckpt=3f2a9c eval.benchmarks=[arith_heldout]` "
            "(a run's summary.json lists its checkpoints)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return ckpts[0], [o for o in overrides if not o.startswith("ckpt=")]


def cmd_eval(args) -> int:
    from core.workspace import Workspace, WorkspaceBusy
    from tasks.checkpoint_eval import EvalInputError, evaluate, format_eval

    ckpt, overrides = _split_ckpt(args.overrides)
    overrides = _with_model(overrides, args.workspace)
    cfg = _load(overrides, preflight=True)
    ws = Workspace.at(args.workspace)
    try:
        with ws.lock():
            from tasks.runner import clear_dead_runs, command_line, new_run_id, save_run_files

            clear_dead_runs(ws, lambda line: print(line, file=sys.stderr))
            run_id, command = new_run_id("eval-"), command_line()
            _quiet_transformers()
            try:
                report = evaluate(cfg, ws, ckpt, run_id, command)
            except EvalInputError as err:
                print(f"laminar: {err}", file=sys.stderr)
                return 2
            save_run_files(ws, run_id, cfg, command)
    except WorkspaceBusy as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 3
    print(format_eval(report))
    print(f"summary: {ws.run_dir(run_id) / 'summary.json'}")
    return 0


def cmd_export(args) -> int:
    from core.workspace import Workspace
    from tasks.checkpoint_eval import EvalInputError
    from tasks.export import export_checkpoint, parse_export_args

    try:
        spec, out = parse_export_args(args.items)
        _quiet_transformers()
        done = export_checkpoint(Workspace.at(args.workspace), spec, out)
    except EvalInputError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    what = f"LoRA adapter merged into its base {done['base']}" if done["adapter"] else "full model"
    print(f"exported {done['checkpoint'][:12]} ({what}) to {done['out']}")
    return 0


def cmd_report(args) -> int:
    from core.workspace import Workspace
    from tasks.report import ReportError, write

    ws = Workspace.at(args.workspace)
    if not ws.catalog.path.exists():
        print(
            f"laminar: no catalog in {ws.root}; pass --workspace DIR of a workspace `laminar run` used",
            file=sys.stderr,
        )
        return 2
    try:
        path = write(ws, args.run_id)
    except ReportError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def cmd_runs(args) -> int:
    import json

    from core.workspace import Workspace
    from tasks.operate import format_runs, list_runs

    ws = Workspace.at(args.workspace)
    if not ws.catalog.path.exists():
        print(
            f"laminar: no catalog in {ws.root}; pass --workspace DIR of a workspace `laminar run` used",
            file=sys.stderr,
        )
        return 2
    listing = list_runs(ws, args.limit)
    from tasks.tracking import format_locations, locations

    for r in listing["runs"]:
        r["tracking"] = locations(ws, r["run_id"])
    print(json.dumps(listing, indent=2, default=str) if args.json else format_runs(listing))
    if not args.json and any(r["tracking"] for r in listing["runs"]):
        print("\n" + format_locations(ws, [r["run_id"] for r in listing["runs"]]))
    return 0


def cmd_lineage(args) -> int:
    import json

    from core.workspace import Workspace
    from tasks.lineage import LineageError, format_lineage, lineage, openlineage_events

    fmt = args.format or ("json" if args.json else "text")
    try:
        lin = lineage(Workspace.at(args.workspace), args.checkpoint, prompts=args.prompts)
    except LineageError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    from tasks.tracking import format_locations, locations

    ws = Workspace.at(args.workspace)
    lin["tracking"] = {
        r: locations(ws, r) for r in dict.fromkeys(n.get("run_id") for n in lin["stages"]) if r
    }
    if fmt == "openlineage":
        for event in openlineage_events(lin):
            print(json.dumps(event, default=str))
    elif fmt == "json":
        print(json.dumps(lin, indent=2, default=str))
    else:
        print(format_lineage(lin))
        if lin["tracking"]:
            print("\n" + format_locations(ws, lin["tracking"]))
    return 0


def cmd_serve(args) -> int:
    from core.workspace import Workspace
    from tasks.runner import command_line
    from tasks.serving import ServeError, auth_file, prefect_api, served_parameters

    cfg = _load(args.overrides, preflight=True)
    selection = _selection(cfg=cfg, until=args.until, force=args.force)
    ws = Workspace.at(args.workspace)
    name = args.name or f"laminar-{ws.root.name}"
    # what every run of the deployment is held to, in the environment before the server starts (its
    # guard answers 403 to a run's parameters that the spec does not allow) and before serve() runs
    parameters = served_parameters(
        ws, args.overrides, selection.force, args.until, command_line() + "  # scheduled run"
    )
    try:
        with prefect_api(ws, args.port, args.cron) as api_url:
            from flows.serve import serve

            print(
                f"laminar: serving deployment laminar-run/{name} on cron {args.cron!r} "
                f"for workspace {ws.root}\n"
                f"laminar: Prefect API {api_url}  UI {api_url.removesuffix('/api')}  (Ctrl-C stops; "
                f"`prefect deployment run laminar-run/{name}` triggers a run now)",
                flush=True,
            )
            if auth_file(ws).exists():
                print(
                    f"laminar: the API and UI ask for the user:password in {auth_file(ws)} (mode 0600; "
                    "PREFECT_API_AUTH_STRING for a Prefect client); a run may pass only overrides",
                    flush=True,
                )
            serve(
                name,
                args.cron,
                parameters,
                description=f"laminar pipeline on {ws.root}: {' '.join(args.overrides) or 'default config'}",
            )
    except ServeError as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def cmd_fsck(args) -> int:
    from core.workspace import Workspace, WorkspaceBusy
    from tasks.fsck import format_fsck, fsck

    ws = Workspace.at(args.workspace)
    if not ws.artifacts.root.is_dir():
        print(
            f"laminar: no artifact store in {ws.root}; "
            "pass --workspace DIR of a workspace `laminar run` used",
            file=sys.stderr,
        )
        return 2
    try:
        result = fsck(ws)
    except WorkspaceBusy as err:
        print(f"laminar: {err}", file=sys.stderr)
        return 3
    lines, summary = format_fsck(ws, result)
    for line in lines:
        print(f"laminar: {line}", file=sys.stderr)
    print(summary)
    return 0 if result.ok else 1


def cmd_simulate(args) -> int:
    from conf.schema import ConfigError
    from conf.simulate import load_simulate_config
    from tasks.simulate import resolve, run_simulation

    try:
        cfg = load_simulate_config(args.overrides)
        resolve(cfg)
    except ConfigError as err:
        print(f"laminar: config error: {err}", file=sys.stderr)
        return 2
    done = run_simulation(cfg, args.workspace, progress=lambda line: print(f"simulated {line}", flush=True))
    print(done["table"])
    speed = done["summary"]["laminar_speedup"]
    if speed:
        print("laminar speedup over " + ", ".join(f"{m} {x:.2f}x" for m, x in speed.items()))
    print(f"summary: {done['out'] / 'simulate.json'}  timelines: {done['out']}/timeline_<mode>.png")
    return 0


def _quiet_transformers() -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)


COMMANDS = {
    "run": cmd_run,
    "rerun": cmd_rerun,
    "status": cmd_status,
    "config": cmd_config,
    "model": cmd_model,
    "eval": cmd_eval,
    "export": cmd_export,
    "report": cmd_report,
    "runs": cmd_runs,
    "lineage": cmd_lineage,
    "serve": cmd_serve,
    "simulate": cmd_simulate,
    "fsck": cmd_fsck,
    "serve-policy": cmd_serve_policy,
}


GLOBAL_OPTIONS = ("--workspace",)
"""Options every subcommand takes; they may also come before the subcommand
    (`laminar --workspace ws status`)."""


def _split_global(argv: list[str]) -> tuple[list[str], list[str]]:
    """The global options written before the subcommand, and the rest of ``argv``."""
    front: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in GLOBAL_OPTIONS and i + 1 < len(argv):
            front += argv[i : i + 2]
            i += 2
        elif arg.split("=", 1)[0] in GLOBAL_OPTIONS and "=" in arg:
            front.append(arg)
            i += 1
        else:
            break
    return front, argv[i:]


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'status'?)`` for a near miss of one of ``choices``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_options(sub: argparse.ArgumentParser, rest: list[str]) -> None:
    """Exit 2 naming the nearest real option for a mistyped ``--option``; argparse says only
    'unrecognized'."""
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and name not in options:
            sub.print_usage(sys.stderr)
            print(
                f"laminar {sub.prog.split()[-1]}: unknown option {name}{did_you_mean(name, options)}",
                file=sys.stderr,
            )
            raise SystemExit(2)


def _plugins_from_cwd() -> None:
    """Plug-ins named by import path (``env.target=my_pkg.agents:solve``) import from the directory
    ``laminar`` runs in, as under ``python -m``: the installed console script puts only its own
    ``bin/`` on ``sys.path``. Appended, so an installed package wins over a same-named local module,
    and exported in ``PYTHONPATH`` for the processes a run starts (Ray workers, stage subprocesses)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, cwd])


def main(argv: list[str] | None = None) -> int:
    """Options may come before, between or after the overrides (`laminar run data=math --until select x=1`);
    global options (``--workspace``) also before the subcommand (`laminar --workspace ws status`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _plugins_from_cwd()
    parser, commands = _parser()
    front, rest = _split_global(argv)
    if rest and rest[0] in commands:
        sub = commands[rest[0]]
        _unknown_options(sub, rest[1:])
        args = sub.parse_intermixed_args(front + rest[1:])  # a later --workspace wins over an earlier one
        args.command = rest[0]
    elif rest and not rest[0].startswith("-"):
        parser.print_usage(sys.stderr)
        print(
            f"laminar: unknown command {rest[0]!r}{did_you_mean(rest[0], commands)}; "
            f"choose from {', '.join(commands)} (`laminar --help` describes them)",
            file=sys.stderr,
        )
        return 2
    else:
        args = parser.parse_args(argv)
    from core.catalog import CatalogBusy
    from core.errors import StageError

    try:
        return COMMANDS[args.command](args)
    except CatalogBusy as err:  # another process kept the catalog locked past the bounded wait
        return _said(err, 3)
    except StageError as err:  # a stage stopped for a reason its one-line message states whole
        return _said(err, 1)


def _said(err: BaseException, code: int) -> int:
    """Print ``err`` as its one line (and its notes) and return ``code``. Its traceback is dropped: the
    frames it holds (the runner's, Prefect's engine's) would keep DuckDB objects alive until the
    interpreter's teardown, which then reports them as leaked."""
    print(f"laminar: {err}", *getattr(err, "__notes__", []), sep="\n", file=sys.stderr)
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return code


if __name__ == "__main__":
    raise SystemExit(main())
