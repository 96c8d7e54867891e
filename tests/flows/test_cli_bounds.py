"""Every config value bounded, checked before anything is written (issue 55, part 5): each case
through the real `laminar run` entry point, in process (no Prefect, no run): one line on stderr,
exit 2, and the workspace (and everything beside it) untouched."""

from __future__ import annotations

import json
import time

import pytest

from flows.cli import main

SOURCE = "data.source=files", "eval.benchmarks=[gsm8k]"


def _files(root):
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _sources(path) -> str:
    return f"data.sources=[{{name: pool, path: {path}}}]"


CASES = {
    "long-key": (
        ["x" * 100_000 + "=1"],
        "override key 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is 100,000",
    ),
    "50k-levels": (["data.levels=[" + ",".join(["1"] * 50_000) + "]"], "override data.levels=... is 100,013"),
    "many-levels": (
        ["data.levels=[" + ",".join(["1"] * 100) + "]"],
        "data.levels lists 100 items; it takes at most 64",
    ),
    "heldout": (["data.heldout_size=100000000"], "data.heldout_size=100000000 is above the limit of 100,000"),
    "threads": (["threads=-3"], "threads=-3 must be >= 0"),
    "seed": (["seed=-1"], "seed=-1 must be >= 0"),
    "hidden": (["model.hidden_size=10000000"], "model.hidden_size=10000000 is above the limit of 65,536"),
    "steps": (["rl.steps=1000000000000"], "rl.steps=1000000000000 is above the limit of 1,000,000"),
    "nesting": (
        ["rl.lr=" + "[" * 3000 + "]" * 3000],
        "override rl.lr=... nests lists or mappings 3,000 deep",
    ),
    "long-path": ([_sources("p" * 5000)], "data.sources[0].path is 5,000 characters long"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_out_of_bounds_value_exits_2_with_one_line_before_any_write(tmp_path, capsys, name):
    overrides, message = CASES[name]
    ws = tmp_path / "ws"
    start = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        main(["run", *overrides, "--workspace", str(ws)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and err.startswith("laminar: config error: ") and message in err, err[:500]
    assert len(err) < 600  # the value is never echoed whole
    assert not ws.exists() and _files(tmp_path) == set()
    assert time.monotonic() - start < 30  # the 50,000-item list once took minutes in Hydra's parser


@pytest.mark.parametrize(
    "file,content,message",
    [
        ("pool.json", "{not json\n", "is not a UTF-8 JSON document"),
        ("pool.parquet", "PAR1 not a parquet file", "Parquet magic bytes not found"),
        ("pool.jsonl", "\n\n", "the prompt pool is empty: its sources hold no rows"),
        ("pool.json", "[]", "the prompt pool is empty: its sources hold no rows"),
    ],
)
def test_a_source_that_cannot_be_read_or_is_empty_fails_in_preflight(
    tmp_path, capsys, file, content, message
):
    """A malformed ``.json``, a fake ``.parquet`` and an empty pool stop `laminar run` before the
    dataset artifact or a run record is written (a pool whose rows ingest all quarantines stops in
    the ingest stage: tests/e2e/test_clean_failure.py)."""
    source = tmp_path / "in" / file
    source.parent.mkdir()
    source.write_text(content)
    before = _files(tmp_path)
    ws = tmp_path / "ws"
    with pytest.raises(SystemExit) as exc:
        main(["run", *SOURCE, _sources(source), "--until", "ingest", "--workspace", str(ws)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert not ws.exists() and _files(tmp_path) == before


def test_allow_empty_lets_an_empty_pool_through_preflight(tmp_path):
    from conf.loader import load_config
    from tasks.preflight import preflight

    source = tmp_path / "pool.json"
    source.write_text(json.dumps([]))
    preflight(load_config([*SOURCE, _sources(source), "data.allow_empty=true"]))


def test_simulate_checks_override_sizes_before_hydra_too(tmp_path, capsys):
    assert main(["simulate", "x" * 100_000 + "=1", "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is 100,000 characters long" in err and not (tmp_path / "ws").exists()
