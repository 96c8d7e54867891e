"""Preference data: comparisons in the common shapes normalised into one ``comparisons`` table.

Shapes (``SHAPES``): ``pairs`` (prompt, chosen, rejected, optional margin and annotator), ``hh``
(two full transcripts that share a prompt prefix, HH-RLHF style), ``trl`` (TRL's standard and
conversational preference formats), ``ranking`` (k responses best first: k(k-1)/2 comparisons) and
``ratings`` (per-response ratings by several annotators: pairs from rating differences, ties kept
or dropped). Bad rows are quarantined with a reason; the rest are deduplicated in DuckDB and their
prompts decontaminated with ``data_curation.decontaminate``. Counts reconcile:
``candidates = comparisons + quarantined + duplicates + contaminated``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHAPES = ("pairs", "hh", "trl", "ranking", "ratings")
MAX_RESPONSE_CHARS = 10_000_000
"""A response this long (10 MB) or longer is quarantined: no reward model reads it."""

COMPARISON_FIELDS = ("comparison_id", "prompt", "chosen", "rejected", "margin", "annotator", "source")


@dataclass(frozen=True)
class PreferenceOptions:
    """``ties``: ``drop`` or ``keep`` equal ratings (a kept tie has margin 0); ``rating_range``: the
    inclusive range a rating must fall in; ``max_response_chars``: the quarantine limit."""

    ties: str = "drop"
    rating_range: tuple[float, float] = (1.0, 5.0)
    max_response_chars: int = MAX_RESPONSE_CHARS

    def validate(self) -> None:
        if self.ties not in ("drop", "keep"):
            raise ValueError(f"ties={self.ties!r}: pass ties=drop or ties=keep")
        lo, hi = self.rating_range
        if not lo < hi:
            raise ValueError(f"rating_range={self.rating_range} must be (low, high) with low < high")


class BadRow(ValueError):
    """A row that cannot become comparisons; its message is the quarantine reason."""


def _text(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        raise BadRow(f"missing field {key}")
    if isinstance(v, list):  # a conversational message list: the assistant's turns
        v = "\n".join(str(m.get("content", "")) for m in v if isinstance(m, dict))
    v = str(v)
    if not v.strip():
        raise BadRow(f"empty field {key}")
    return v


def _pair(prompt: str, chosen: str, rejected: str, margin=None, annotator=None) -> dict:
    if chosen.strip() == rejected.strip():
        raise BadRow("identical responses")
    return {
        "prompt": prompt,
        "chosen": chosen,
        "rejected": rejected,
        "margin": margin,
        "annotator": annotator,
    }


def _from_pairs(row: dict, opt: PreferenceOptions) -> list[dict]:
    margin = row.get("margin")
    annotator = row.get("annotator")
    return [
        _pair(
            _text(row, "prompt"),
            _text(row, "chosen"),
            _text(row, "rejected"),
            None if margin is None else float(margin),
            None if annotator is None else str(annotator),
        )
    ]


def _split_transcripts(chosen: str, rejected: str) -> tuple[str, str, str]:
    """The shared prompt prefix (up to the last ``Assistant:`` both share) and the two replies."""
    marker = "Assistant:"
    common = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        common += 1
    cut = chosen.rfind(marker, 0, common + 1)
    if cut < 0:
        raise BadRow("transcripts share no prompt prefix ending in 'Assistant:'")
    cut += len(marker)
    return chosen[:cut].strip(), chosen[cut:].strip(), rejected[cut:].strip()


def _from_hh(row: dict, opt: PreferenceOptions) -> list[dict]:
    prompt, chosen, rejected = _split_transcripts(_text(row, "chosen"), _text(row, "rejected"))
    if not chosen or not rejected:
        raise BadRow("empty field chosen" if not chosen else "empty field rejected")
    return [_pair(prompt, chosen, rejected)]


def _from_trl(row: dict, opt: PreferenceOptions) -> list[dict]:
    """Standard (strings) or conversational (message lists) ``prompt``/``chosen``/``rejected``."""
    return [_pair(_text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected"))]


def _from_ranking(row: dict, opt: PreferenceOptions) -> list[dict]:
    prompt = _text(row, "prompt")
    ranked = row.get("ranking")
    if not isinstance(ranked, list) or len(ranked) < 2:
        raise BadRow("missing field ranking (a list of at least 2 responses, best first)")
    ranked = [str(r) for r in ranked]
    if any(not r.strip() for r in ranked):
        raise BadRow("empty field ranking")
    if len(set(r.strip() for r in ranked)) != len(ranked):
        raise BadRow("ranking with repeats")
    annotator = row.get("annotator")
    return [
        _pair(prompt, ranked[i], ranked[j], float(j - i), None if annotator is None else str(annotator))
        for i, j in itertools.combinations(range(len(ranked)), 2)
    ]


def _from_ratings(row: dict, opt: PreferenceOptions) -> list[dict]:
    """``responses``: [{text, ratings: {annotator: score}}]; one pair per annotator per response pair
    they rated differently (margin = the difference)."""
    prompt = _text(row, "prompt")
    responses = row.get("responses")
    if not isinstance(responses, list) or len(responses) < 2:
        raise BadRow("missing field responses (a list of at least 2 rated responses)")
    lo, hi = opt.rating_range
    texts = [_text(r, "text") for r in responses]
    if len(set(t.strip() for t in texts)) != len(texts):
        raise BadRow("identical responses")
    for r in responses:
        for who, score in (r.get("ratings") or {}).items():
            if score is None or not lo <= float(score) <= hi:
                raise BadRow(f"rating out of range: {score} by {who} (range {lo} to {hi})")
    out = []
    for a, b in itertools.combinations(range(len(responses)), 2):
        ra, rb = responses[a].get("ratings") or {}, responses[b].get("ratings") or {}
        for who in sorted(set(ra) & set(rb)):
            diff = float(ra[who]) - float(rb[who])
            if diff == 0 and opt.ties == "drop":
                continue
            first, second = (a, b) if diff >= 0 else (b, a)
            out.append(_pair(prompt, texts[first], texts[second], abs(diff), str(who)))
    return out


_SHAPE_FNS = {
    "pairs": _from_pairs,
    "hh": _from_hh,
    "trl": _from_trl,
    "ranking": _from_ranking,
    "ratings": _from_ratings,
}


def normalise(
    rows: Iterable[dict], shape: str, source: str, opt: PreferenceOptions = PreferenceOptions()
) -> tuple[list[dict], list[dict]]:
    """(comparisons, quarantined rows) from ``rows`` of ``shape``; a quarantined row keeps its
    index, its ``reason`` and how many comparisons it would have counted for (1 when unknown)."""
    if shape not in _SHAPE_FNS:
        raise ValueError(f"unknown preference shape {shape!r}; shapes are {', '.join(SHAPES)}")
    opt.validate()
    good, bad = [], []
    for i, row in enumerate(rows):
        try:
            pairs = _SHAPE_FNS[shape](row, opt)
            for p in pairs:
                for k in ("prompt", "chosen", "rejected"):
                    if len(p[k]) >= opt.max_response_chars:
                        raise BadRow(f"{k} of {len(p[k])} characters (limit {opt.max_response_chars})")
        except BadRow as e:
            bad.append({"source": source, "row": i, "reason": str(e)})
            continue
        good.extend({**p, "source": source, "row": i} for p in pairs)
    return good, bad


def comparison_id(prompt: str, chosen: str, rejected: str, annotator: str | None) -> str:
    key = "\x1f".join((prompt.strip(), chosen.strip(), rejected.strip(), annotator or ""))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


_DEDUP_SQL = """
SELECT * EXCLUDE (rk) FROM (
  SELECT *, row_number() OVER (PARTITION BY comparison_id ORDER BY source, "row") AS rk FROM _cands
) WHERE rk = 1 ORDER BY source, "row", comparison_id
"""


def agreement(comparisons: Sequence[dict]) -> dict[str, float]:
    """Annotator agreement where annotators are known: over every unordered response pair judged by
    at least two annotators, the mean share of judgements that side with the pair's majority
    (``agreement``, the ceiling a reward model can reach on these labels) and the pairs counted."""
    votes: dict[tuple, list[int]] = defaultdict(list)
    for c in comparisons:
        if c.get("annotator") is None:
            continue
        a, b = c["chosen"].strip(), c["rejected"].strip()
        key = (c["prompt"].strip(), *sorted((a, b)))
        votes[key].append(1 if a == key[1] else 0)
    shared = [v for v in votes.values() if len(v) >= 2]
    if not shared:
        return {"agreement_pairs": 0.0}
    share = [max(sum(v), len(v) - sum(v)) / len(v) for v in shared]
    return {"agreement": sum(share) / len(share), "agreement_pairs": float(len(shared))}


_CANDIDATE_TYPES = {
    "comparison_id": pa.string(),
    "prompt": pa.string(),
    "chosen": pa.string(),
    "rejected": pa.string(),
    "margin": pa.float64(),
    "annotator": pa.string(),
    "source": pa.string(),
    "row": pa.int64(),
}
_QUARANTINE_TYPES = {"source": pa.string(), "row": pa.int64(), "reason": pa.string()}


def _normalise_sources(
    sources: Sequence[tuple[str, str, Iterable[dict]]], opt: PreferenceOptions
) -> tuple[list[dict], list[dict], int]:
    """(comparisons with their ``comparison_id``, quarantined rows, rows read) over all ``sources``."""
    good, bad, rows_in = [], [], 0
    for name, shape, rows in sources:
        rows = list(rows)
        rows_in += len(rows)
        g, b = normalise(rows, shape, name, opt)
        good += g
        bad += b
    for c in good:
        c["comparison_id"] = comparison_id(c["prompt"], c["chosen"], c["rejected"], c["annotator"])
    return good, bad, rows_in


def _unique_comparisons(cands: pa.Table) -> pa.Table:
    """``cands`` with one row per comparison_id, the first by (source, row), in that order."""
    from data_curation.db import memory_db

    con = memory_db()
    try:
        con.register("_cands", cands)
        return con.sql(_DEDUP_SQL).to_arrow_table()
    finally:
        con.close()


def _clean_prompts(
    prompts: Sequence[str], out_dir: Path, benchmark_items: Iterable, decontam: dict
) -> tuple[set[str], dict[str, float]]:
    """The ``prompts`` that decontamination keeps (writing its outputs under ``out_dir``), and its
    counts."""
    from data_curation.decontaminate import decontaminate

    pid = {p: f"pref{hashlib.sha256(p.encode()).hexdigest()[:12]}" for p in prompts}
    scratch = out_dir / "_prompts"
    scratch.mkdir(exist_ok=True)
    pq.write_table(
        pa.table({"prompt_id": [pid[p] for p in prompts], "problem": prompts}),
        scratch / "prompts.parquet",
    )
    dc = decontaminate(scratch / "prompts.parquet", benchmark_items, out_dir / "decontam", **decontam)
    clean = set(pq.read_table(out_dir / "decontam" / "prompts.parquet")["prompt_id"].to_pylist())
    return {p for p in prompts if pid[p] in clean}, dc


def ingest_preferences(
    sources: Sequence[tuple[str, str, Iterable[dict]]],
    out_dir: Path,
    benchmark_items: Iterable = (),
    opt: PreferenceOptions = PreferenceOptions(),
    **decontam,
) -> dict[str, float]:
    """Normalise ``sources`` (name, shape, rows), deduplicate in DuckDB, decontaminate the prompts
    against ``benchmark_items`` (``decontam``: ``data_curation.decontaminate.decontaminate``'s
    keywords). Writes ``comparisons.parquet`` and ``quarantine.parquet`` to ``out_dir``; returns the
    counts (they reconcile: candidates = comparisons + quarantined + duplicates + contaminated)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    good, bad, rows_in = _normalise_sources(sources, opt)
    cands = pa.table({k: pa.array([c[k] for c in good], t) for k, t in _CANDIDATE_TYPES.items()})
    unique = _unique_comparisons(cands)
    clean, dc = _clean_prompts(sorted(set(unique["prompt"].to_pylist())), out_dir, benchmark_items, decontam)
    comparisons = unique.filter(pa.array([p in clean for p in unique["prompt"].to_pylist()]))
    comparisons = comparisons.drop_columns(["row"])
    pq.write_table(comparisons, out_dir / "comparisons.parquet")
    pq.write_table(
        pa.table({k: pa.array([b[k] for b in bad], t) for k, t in _QUARANTINE_TYPES.items()}),
        out_dir / "quarantine.parquet",
    )
    counts = {
        "rows_in": float(rows_in),
        "candidates": float(len(good) + len(bad)),
        "comparisons": float(comparisons.num_rows),
        "quarantined": float(len(bad)),
        "duplicates": float(cands.num_rows - unique.num_rows),
        "contaminated": float(unique.num_rows - comparisons.num_rows),
        "contaminated_prompts": dc["contaminated"],
    }
    counts.update(agreement(comparisons.to_pylist()))
    return counts


def load_comparisons(con, path: Path, table: str = "comparisons") -> int:
    """Create (or replace) the DuckDB table ``table`` from a ``comparisons.parquet``; its row count."""
    con.execute(f"CREATE OR REPLACE TABLE {table} AS SELECT * FROM read_parquet(?)", [str(path)])
    return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
