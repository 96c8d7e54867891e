"""Docs that cannot rot: every command shown in README.md and docs/*.md is checked against the code.

Fenced code blocks:

- a block directly below the line ``<!-- runnable -->`` is executed: each ``laminar ...`` line runs
  through the real CLI (``python -m flows.cli``) against a temporary workspace holding an empty
  catalog and must exit 0. Only fast, read-only subcommands may be runnable (``RUNNABLE``);
- a block directly below ``<!-- config-error -->`` holds ``$ laminar ...`` lines that must fail
  config validation, each with the message on its ``laminar: config error: ...`` line (a trailing
  ``...`` cuts the expected message short);
- every other ``laminar ...`` line is parsed with the CLI's own argparse parser (the subcommand exists,
  its flags are accepted), its ``key=value`` overrides are composed and validated by the config
  loader (``conf.loader.load_config``; ``conf.simulate.load_simulate_config`` for ``simulate``),
  benchmark names and DeepSpeed configs are checked against their registries and stage names
  against the DAG; ``make`` targets must exist in the Makefile (``ARGS="..."`` is checked as
  ``laminar run`` overrides); ``python path/to/script.py`` must name an existing file.

Prose (outside fences): an inline ``laminar ...`` span must name a real subcommand and only its flags,
a ``make ...`` span a real target, a span naming a config key (``rl.max_staleness``,
``rl.algorithm=dapo``) a key of the pipeline's or the simulator's schema, ``group=option`` an existing
option file, a repository path an existing file or folder, and a relative link an existing file.
``benchmarks/results/README.md`` (where measurements live) must cite only results files that exist.

Nothing here trains: the whole module takes seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conf.schema import Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("runnable", "config-error")
RUNNABLE = {"config", "status", "runs"}
"""Subcommands a runnable block may run (fast and read-only); any subcommand may run with ``--help``."""
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
TOP_LEVEL = (
    "core",
    "conf",
    "generation",
    "rewards",
    "evaluation",
    "data_curation",
    "training",
    "tasks",
    "flows",
    "benchmarks",
    "tests",
    "docs",
)
REPO_PATH = re.compile(
    rf"^(?:\./)?((?:{'|'.join(TOP_LEVEL)})/[\w./*-]*|README\.md|Makefile|pyproject\.toml|requirements\.txt)$"
)
CONFIG_REF = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?:=.*)?$")
FILE_SUFFIXES = {"py", "md", "yaml", "json", "jsonl", "png", "parquet", "duckdb", "txt", "log"}
GROUP_OPTION = re.compile(r"^(model|data|sft|rl|eval|reward|recipe)=([\w-]+)$")


# ------------------------------------------------------------------------------------------ reading docs
@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    marker: str | None
    lines: tuple[tuple[int, str], ...]  # (1-based line, text) of the block's content


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    marker: str | None
    words: tuple[str, ...]
    expected_error: str | None = None  # config-error blocks: the message the docs show

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {' '.join(self.words)[:70]}"


def blocks(doc: Path) -> list[Block]:
    """Fenced code blocks, each with the marker comment directly above its opening fence (if any)."""
    out, lines = [], doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        above = MARKER.match(lines[i - 1]) if i else None
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append((i + 1, lines[i]))
            i += 1
        out.append(Block(doc, start + 1, above.group(1) if above else None, tuple(body)))
        i += 1
    return out


def prose(doc: Path) -> list[tuple[int, str]]:
    """(line, text) of every line outside fenced blocks."""
    inside, fence, out = False, "", []
    for n, text in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(text)
        if m and (not inside or text.strip().startswith(fence)):
            inside, fence = (not inside), m.group(2)
            continue
        if not inside:
            out.append((n, text))
    return out


def _is_laminar(word: str) -> bool:
    return word == "laminar" or word.endswith("/laminar")


def _is_checked(word: str) -> bool:
    return _is_laminar(word) or word == "make" or Path(word).name.startswith("python")


def _split(text: str) -> list[str] | None:
    """Shell words of a (joined) command line; None while a quote is still open."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    for stop in ("|", "&&", ";", ">", "2>"):
        if stop in words:
            words = words[: words.index(stop)]
    return words


def commands(block: Block) -> list[Command]:
    """The ``laminar``, ``make`` and ``python`` commands of a block (other lines are left alone):
    backslash continuations and quotes spanning lines are joined, a leading ``$ `` prompt and
    ``NAME=value`` environment assignments are dropped. In a config-error
    block only ``$`` lines are commands; the ``laminar: config error:`` line after one is its message."""
    out: list[Command] = []
    pending, first = "", 0
    for n, raw in block.lines:
        text = raw.strip()
        if block.marker == "config-error" and not pending:
            if text.startswith("laminar: config error:") and out:
                msg = text.removeprefix("laminar: config error:").strip()
                out[-1] = dataclasses.replace(out[-1], expected_error=re.sub(r"\s*\.\.\.$", "", msg))
                continue
            if not text.startswith("$ "):
                continue
        if not pending:
            text = text.removeprefix("$ ")
            head = [w for w in text.split() if not ENV_ASSIGNMENT.match(w)][:1]
            if not head or not _is_checked(head[0]):  # prose, output or a command nobody checks
                continue
            first = n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        pending += text
        words = _split(pending)
        if words is None:  # a quoted argument goes on on the next line
            pending += "\n"
            continue
        pending = ""
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words:
            out.append(Command(block.doc, first, block.marker, tuple(words)))
    assert not pending, f"{block.doc.name}:{block.line}: unterminated command {pending!r}"
    return out


ALL_BLOCKS = [b for doc in DOCS for b in blocks(doc)]
ALL_COMMANDS = [c for b in ALL_BLOCKS for c in commands(b)]
LAMINAR = [c for c in ALL_COMMANDS if _is_laminar(c.words[0])]
MAKE = [c for c in ALL_COMMANDS if c.words[0] == "make"]
SCRIPTS = [
    c
    for c in ALL_COMMANDS
    if Path(c.words[0]).name.startswith("python") and len(c.words) > 1 and c.words[1].endswith(".py")
]


# ------------------------------------------------------------------------------------------ the checks
@functools.cache
def cli():
    """The CLI's parser and its subparsers, exactly as ``laminar`` builds them."""
    from flows.cli import _parser

    return _parser()


def parse(argv: list[str]):
    """Parse like ``flows.cli.main``; returns (namespace or None for --help, subparser or None).
    Raises AssertionError with argparse's message when the CLI would reject the line."""
    parser, subs = cli()
    sub = subs.get(argv[0]) if argv else None
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            if sub:
                args = sub.parse_intermixed_args(argv[1:])
                args.command = argv[0]
            else:
                args = parser.parse_args(argv)
    except SystemExit as exit_:
        if exit_.code in (0, None):  # --help
            return None, sub
        raise AssertionError(
            f"the CLI rejects `laminar {' '.join(argv)}`: {err.getvalue().strip()}"
        ) from None
    return args, sub


@functools.cache
def benchmark_names() -> tuple[str, ...]:
    from evaluation.benchmarks import BENCHMARKS
    from evaluation.stages import HELDOUT

    return (HELDOUT, *BENCHMARKS)


def check_overrides(command: str, overrides: list[str]) -> None:
    """Compose and validate the config a command's overrides give (nothing runs, nothing is written)."""
    from conf.schema import ConfigError

    try:
        if command == "simulate":
            from conf.simulate import load_simulate_config
            from tasks.simulate import resolve

            resolve(load_simulate_config(overrides))
            return
        from conf.loader import deepspeed_config, load_config

        cfg = load_config(overrides)
        unknown = [b for b in cfg.eval.benchmarks if isinstance(b, str) and b not in benchmark_names()]
        if unknown:
            raise AssertionError(
                f"unknown benchmark {unknown[0]!r}; benchmarks are {', '.join(benchmark_names())}"
            )
        if cfg.trainer.backend == "deepspeed":
            deepspeed_config(cfg.trainer.deepspeed)
    except ConfigError as err:
        raise AssertionError(f"config error for {overrides}: {err}") from None


def stage_config(args) -> Config | None:
    """The config whose graph a line's stage names are checked against: its overrides' when it names
    a round's stage (``rl@2`` needs ``rounds=2``), else the default's (None)."""
    named = [
        getattr(args, "until", None),
        getattr(args, "stage", None),
        *(getattr(args, "force", None) or []),
    ]
    if not any(n and "@" in n for n in named) or not hasattr(args, "overrides"):
        return None
    from conf.loader import load_config

    return load_config(list(args.overrides or []))


def check_laminar(words: tuple[str, ...]) -> None:
    """The line parses, and what it names (config keys, stages, benchmarks) exists."""
    argv = list(words[1:])
    args, _ = parse(argv)
    if args is None:
        return
    from tasks.dag import UnknownStage, select

    try:
        select(
            until=getattr(args, "until", None),
            force=getattr(args, "force", []),
            rerun=getattr(args, "stage", None),
            cfg=stage_config(args),
        )
    except UnknownStage as err:
        raise AssertionError(f"`laminar {' '.join(argv)}`: {err}") from None
    overrides = list(getattr(args, "overrides", None) or [])
    if args.command == "eval":
        ckpts = [o for o in overrides if o.startswith("ckpt=")]
        if len(ckpts) != 1 or ckpts[0] == "ckpt=":
            raise AssertionError(f"`laminar {' '.join(argv)}`: eval needs exactly one ckpt=...")
        overrides = [o for o in overrides if not o.startswith("ckpt=")]
    if hasattr(args, "overrides"):
        check_overrides(args.command, overrides)


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for line in text.splitlines():
        m = re.match(r"^([\w.-]+(?:\s+[\w.-]+)*)\s*:(?![=:])", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return frozenset(targets - {".PHONY"})


def check_make(words: tuple[str, ...]) -> None:
    for word in words[1:]:
        if word.startswith("ARGS="):
            check_laminar(("laminar", "run", *shlex.split(word.removeprefix("ARGS="))))
        elif "=" not in word and not word.startswith("-"):
            if word not in make_targets():
                raise AssertionError(
                    f"`make {word}`: no such target; the Makefile has {sorted(make_targets())}"
                )


def _schemas():
    from conf.schema import Config
    from conf.simulate import SimulateConfig

    return Config, SimulateConfig


def _has_key(schema, parts: list[str]) -> bool:
    from pydantic import BaseModel

    for i, part in enumerate(parts):
        if part not in schema.model_fields:
            return False
        inner = schema.model_fields[part].annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            schema = inner
        else:
            return i == len(parts) - 1
    return True


def check_prose(doc: Path) -> list[str]:
    """Inline code spans and relative links outside fences: what they name exists."""
    parser_, subs = cli()
    tops = {name for schema in _schemas() for name in schema.model_fields}
    problems = []
    for n, text in prose(doc):
        where = f"{doc.relative_to(ROOT)}:{n}"
        for span in re.findall(r"`([^`\n]+)`", text):
            span = span.strip()
            words = span.split()
            if words and _is_laminar(words[0]):
                if len(words) > 1 and not words[1].startswith("-"):
                    if words[1] not in subs:
                        problems.append(f"{where}: `{span}`: no subcommand {words[1]!r}")
                        continue
                    options = subs[words[1]]._option_string_actions
                else:
                    options = parser_._option_string_actions
                problems += [
                    f"{where}: `{span}`: {w.split('=')[0]} is not an option of it"
                    for w in words[2:]
                    if w.startswith("-") and w.split("=")[0] not in options
                ]
            elif words and words[0] == "make":
                try:
                    check_make(tuple(shlex.split(span)))
                except AssertionError as err:
                    problems.append(f"{where}: {err}")
            elif len(words) > 1 and Path(words[0]).name.startswith("python") and words[1].endswith(".py"):
                if not (ROOT / words[1]).is_file():
                    problems.append(f"{where}: `{span}`: {words[1]} does not exist")
            elif REPO_PATH.match(span):
                path = REPO_PATH.match(span).group(1)
                if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                    problems.append(f"{where}: `{span}` does not exist")
            elif GROUP_OPTION.match(span):
                group, option = GROUP_OPTION.match(span).groups()
                if not (ROOT / "conf" / group / f"{option}.yaml").exists():
                    problems.append(f"{where}: `{span}`: no conf/{group}/{option}.yaml")
            elif (
                CONFIG_REF.match(span)
                and span.split(".")[0] in tops
                and span.split("=")[0].rsplit(".")[-1] not in FILE_SUFFIXES
            ):
                parts = CONFIG_REF.match(span).group(1).split(".")
                if not any(_has_key(schema, parts) for schema in _schemas()):
                    problems.append(
                        f"{where}: `{span}`: no config key {'.'.join(parts)} "
                        "(conf/schema.py, conf/simulate.py)"
                    )
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                problems.append(f"{where}: link to {target} does not exist")
    return problems


# ------------------------------------------------------------------------------------------ the tests
def test_docs_have_commands_and_a_runnable_block():
    assert len(DOCS) > 1 and len(LAMINAR) > 20, [d.name for d in DOCS]
    assert any(c.marker == "runnable" for c in LAMINAR), (
        "no runnable block left: the docs would no longer be run"
    )
    assert any(c.marker == "config-error" for c in LAMINAR)


def test_only_known_markers_sit_above_fences():
    unknown = [
        f"{b.doc.name}:{b.line - 1}: <!-- {b.marker} -->"
        for b in ALL_BLOCKS
        if b.marker is not None and b.marker not in MARKERS
    ]
    assert not unknown, f"unknown marker above a code block (known: {MARKERS}): {unknown}"


def test_every_doc_is_in_the_readme_index():
    readme = (ROOT / "README.md").read_text()
    missing = [d.name for d in DOCS[1:] if f"(docs/{d.name})" not in readme]
    assert not missing, f"docs/ files missing from README's docs index: {missing}"


README_WORDS = 1200
"""README.md is the five-minute tour; depth lives in docs/ (docs/architecture.md is the map)."""


def test_the_readme_stays_a_five_minute_tour():
    words = len((ROOT / "README.md").read_text().split())
    assert words < README_WORDS, f"README.md has {words} words (< {README_WORDS}): move depth to docs/"


@pytest.mark.parametrize("cmd", [c for c in LAMINAR if c.marker != "config-error"], ids=lambda c: c.id)
def test_laminar_command_parses_and_names_real_config(cmd):
    check_laminar(cmd.words)


@pytest.mark.parametrize("cmd", MAKE, ids=lambda c: c.id)
def test_make_target_exists(cmd):
    check_make(cmd.words)


def test_scripts_exist():
    missing = [c.id for c in SCRIPTS if not (ROOT / c.words[1]).is_file()]
    assert not missing, f"scripts that do not exist: {missing}"


@pytest.mark.parametrize("cmd", [c for c in LAMINAR if c.marker == "config-error"], ids=lambda c: c.id)
def test_config_error_example_fails_as_shown(cmd):
    from conf.loader import load_config
    from conf.schema import ConfigError

    args, _ = parse(list(cmd.words[1:]))
    assert args is not None and hasattr(args, "overrides"), f"{cmd.id}: not a command that reads the config"
    with pytest.raises(ConfigError) as err:
        load_config(args.overrides)
    if cmd.expected_error:
        assert str(err.value).startswith(cmd.expected_error), (
            f"{cmd.id}: the docs show\n  {cmd.expected_error}\nthe CLI says\n  {err.value}"
        )


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_prose_names_real_commands_keys_and_paths(doc):
    problems = check_prose(doc)
    assert not problems, "\n".join(problems)


def test_results_index_names_existing_files():
    """benchmarks/results/README.md: every results file and script it cites exists."""
    index = ROOT / "benchmarks" / "results" / "README.md"
    results = index.parent
    missing = []
    for n, text in prose(index):
        for span in re.findall(r"`([^`\n]+)`", text):
            if REPO_PATH.match(span):
                found = (ROOT / REPO_PATH.match(span).group(1)).exists()
            elif re.match(r"^[\w.-]+(/[\w.-]+)*/?$", span) and re.search(r"(\.(json|log|md|png)|/)$", span):
                found = (results / span).exists() or any(results.rglob(span))
            else:
                continue
            if not found:
                missing.append(f"benchmarks/results/README.md:{n}: `{span}`")
    assert not missing, "cited results that do not exist:\n" + "\n".join(missing)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A fresh workspace with an empty catalog (what `laminar runs` lists before any run)."""
    from core.workspace import Workspace

    root = tmp_path_factory.mktemp("docs") / "workspace"
    ws = Workspace.at(root)
    ws.create()
    with ws.catalog.connect():
        pass
    return root


@pytest.mark.parametrize("cmd", [c for c in LAMINAR if c.marker == "runnable"], ids=lambda c: c.id)
def test_runnable_command_runs(cmd, workspace):
    argv = list(cmd.words[1:])
    _, sub = parse(argv)
    helps = {"-h", "--help"} & set(argv)
    assert helps or (sub is not None and argv[0] in RUNNABLE), (
        f"{cmd.id}: runnable blocks may only run {sorted(RUNNABLE)} or --help (fast, read-only)"
    )
    if sub is not None and not helps and "--workspace" not in argv:
        argv += ["--workspace", str(workspace)]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LAMINAR_WORKSPACE": str(workspace),
        "PREFECT_HOME": str(workspace.parent / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"{cmd.id} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    )
