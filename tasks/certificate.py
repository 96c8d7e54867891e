"""The decontamination certificate of a score: was everything the checkpoint learned from checked
against this exact benchmark file?

The checkpoint's whole upstream tree is read from the catalog (``artifact_edges``, child to parent,
to the roots): every decontaminated pool in it (warm-up, RFT and RL prompts all come from one) and
every model at its root. Per benchmark, given the sha256 of the file the score was computed on:

- ``unknown-origin``: a root model is not the project's own from-scratch model (``model.kind=hf``,
  a ``model.path`` whose training data nobody here checked), or the checkpoint came from outside
  the store (``laminar eval ckpt=<folder>``), so its lineage is unknown;
- ``not-checked``: some decontaminated pool in the tree was not checked against this benchmark, or
  against another version of its file (a benchmark added or replaced after curation ran), or the
  checkpoint was trained and no decontaminated pool is in its tree;
- ``contaminated-removed``: every pool was checked against this file and some prompts matched it
  and were removed before training;
- ``clean``: every pool was checked against this file and nothing matched (or the model was
  trained on nothing: a from-scratch base model).

Each certificate also names the rules the pools were checked with and the pools themselves.

A reward model's comparisons (stage ``preferences``) count as a pool: their prompts were
decontaminated too (``decontam/certificate.json`` in the artifact), so a checkpoint trained against a
learned reward is ``clean`` only when the preference prompts were checked as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

__all__ = ["STATUSES", "certify", "connection_query"]

STATUSES = ("clean", "contaminated-removed", "not-checked", "unknown-origin")
CERTIFICATE_FILE = "certificate.json"

Query = Callable[[str, Sequence[Any]], list[dict]]

_UPSTREAM_SQL = """
    WITH RECURSIVE up(kind, sha) AS (
        SELECT ?::VARCHAR, ?::VARCHAR
        UNION
        SELECT e.parent_kind, e.parent_sha FROM artifact_edges e JOIN up ON e.child_sha = up.sha
    )
    SELECT up.kind, up.sha, a.stage, a.path, a.cache_key,
           (SELECT count(*) FROM artifact_edges e WHERE e.child_sha = up.sha) AS parents
    FROM up LEFT JOIN artifacts a ON a.kind = up.kind AND a.sha256 = up.sha
    ORDER BY up.kind, up.sha
"""


def connection_query(con: Any) -> Query:
    """A ``Query`` over an open DuckDB connection (a record hook's)."""

    def query(sql: str, params: Sequence[Any] = ()) -> list[dict]:
        cur = con.execute(sql, list(params))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]

    return query


def _model_kind(query: Query, cache_key: str | None) -> str | None:
    """``model.kind`` of the run(s) that made a base model under ``cache_key``."""
    if not cache_key:
        return None
    for row in query(
        "SELECT r.config_json FROM stage_runs s JOIN runs r USING (run_id) WHERE s.cache_key = ? "
        "ORDER BY s.finished_at",
        [cache_key],
    ):
        try:
            return json.loads(row["config_json"] or "{}")["model"]["kind"]
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _read_pool_certificate(path: str | None, root: Path | None) -> dict | None:
    """A pool's ``certificate.json``; a relative ``path`` (as the catalog stores it) is under ``root``."""
    if not path:
        return None
    file = (Path(path) if root is None or Path(path).is_absolute() else Path(root) / path) / CERTIFICATE_FILE
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def certify(
    query: Query,
    checkpoint_sha: str,
    benchmarks: Mapping[str, str],
    kind: str = "model",
    root: Path | None = None,
) -> dict[str, dict]:
    """benchmark -> certificate (``status``, ``benchmark_sha256``, ``rules``, ``pools``, ``detail``)
    for the checkpoint ``checkpoint_sha`` scored on ``benchmarks`` (name -> sha256 of its file).
    ``root``: the workspace root the catalog's relative artifact paths are under."""
    tree = query(_UPSTREAM_SQL, [kind, checkpoint_sha])
    unknown: list[str] = []
    trained = False
    pools: list[tuple[str, dict | None]] = []
    for node in tree:
        if node["kind"] == "model":
            if node["parents"]:
                trained = True
                continue
            if node["stage"] == "base_model":
                model_kind = _model_kind(query, node["cache_key"])
                if model_kind == "tiny":
                    continue
                unknown.append(
                    f"base model {node['sha'][:12]} "
                    + (
                        "loaded from model.path (model.kind=hf): its training data is not known here"
                        if model_kind == "hf"
                        else "of unknown kind"
                    )
                )
            else:
                unknown.append(
                    f"checkpoint {node['sha'][:12]} came from outside the store"
                    + (f" (stage {node['stage']})" if node["stage"] else "")
                )
        elif node["stage"] == "decontaminate":
            pools.append((node["sha"], _read_pool_certificate(node["path"], root)))
        elif node["stage"] == "preferences" and node["path"]:  # a reward model's comparisons: their prompts
            pools.append((node["sha"], _read_pool_certificate(str(Path(node["path"]) / "decontam"), root)))
    rules = sorted({r for _, c in pools if c for r in c.get("rules", [])})
    out: dict[str, dict] = {}
    for bench, sha in benchmarks.items():
        cert = {
            "status": "clean",
            "benchmark_sha256": sha,
            "rules": rules,
            "pools": [p for p, _ in pools],
            "detail": "",
        }
        missing, other_file, removed = [], [], 0
        for pool, c in pools:
            entry = (c or {}).get("benchmarks", {}).get(bench)
            if entry is None:
                checked = sorted((c or {}).get("benchmarks", {}))
                missing.append(f"pool {pool[:12]} was checked against {checked or 'nothing on record'}")
            elif entry.get("sha256") != sha:
                other_file.append(
                    f"pool {pool[:12]} was checked against another {bench} file "
                    f"({str(entry.get('sha256'))[:12]})"
                )
            else:
                removed += int(entry.get("removed") or 0)
        if unknown:
            cert.update(status="unknown-origin", detail="; ".join(unknown))
        elif missing or other_file:
            cert.update(status="not-checked", detail="; ".join(missing + other_file))
        elif trained and not pools:
            cert.update(status="not-checked", detail="no decontaminated pool in the checkpoint's lineage")
        elif removed:
            cert.update(
                status="contaminated-removed", detail=f"{removed} matching prompt(s) removed before training"
            )
        else:
            cert["detail"] = "no training data (a from-scratch model)" if not trained else "no prompt matched"
        out[bench] = cert
    return out
