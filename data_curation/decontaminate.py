"""Remove prompts that overlap an evaluation benchmark: an n-gram rule, then a paraphrase rule.

Texts are NFKC-normalised (``ingest.normalize_text``), lowercased and cut into tokens with the
RE2 regex ``TOKEN_RE`` (Unicode ``\\w+|[^\\w\\s]``: "3+4" is three tokens). Every window of
``ngram`` consecutive tokens becomes one 63-bit hash; a text with fewer than ``ngram`` tokens is
one gram made of its whole token sequence, so a short benchmark problem ("What is 3+4-2?")
matches a prompt that is exactly that problem, never through its sub-sequences. Tokenising,
hashing and the join all run in DuckDB SQL. Benchmark items are only read, never modified.

A prompt is contaminated by a benchmark item when the grams they share cover at least
``min_coverage`` (default 0.7) of the item's tokens. A copy covers all of it; one edited word in
the middle loses one token, one within 12 tokens of either end loses up to 12 (so a single edit
anywhere is caught in items of 40 tokens or more). One shared gram is not enough: with punctuation
as tokens, 13 tokens span a few words of LaTeX or Asymptote boilerplate. On the vendored MATH
train pool (7,462 prompts after ingest) against the five vendored benchmarks, "any shared 13-gram"
flags 1,299 prompts; coverage >= 0.5 flags 95, mostly template siblings ("Convert the point ...
to polar coordinates. Enter your answer in the form ..."); >= 0.7 flags 27 and >= 0.8 flags 18,
all against MATH-500: the same figure or setup with another question, or a shared template.

A rewritten copy (symbols renamed, a figure dropped, numbers in words) shares too few 13-grams to
reach that coverage. The prompts the n-gram rule keeps then go through the paraphrase rule
(:func:`paraphrase_hits`): MinHash/LSH candidates over shingles of normalised text
(:func:`paraphrase_text`), verified exactly in DuckDB, flagged when the score is high, or moderate
and the canonical answers agree. Measured by ``benchmarks/decontamination.py``: every planted
rewrite of five kinds caught, 2 extra flags (0.03%) on MATH train, about 2 s more at that scale.

Outputs in ``out_dir``: ``prompts.parquet`` (the input table, contaminated rows removed, order and
schema kept), ``contamination.parquet`` (one row per contaminated prompt and benchmark item:
prompt_id, source, benchmark, benchmark_problem_id, matched (the prompt's first shared gram, tokens
joined by spaces; null for the paraphrase rule), overlap (distinct shared grams or shingles),
coverage (n-gram rule), rule (``ngram``, ``paraphrase`` or ``paraphrase+answer``: the moderate score
let through by the same answer), score (coverage, or the paraphrase score)), ordered by prompt, then
item, and ``certificate.json`` (per benchmark: the sha256 of its file, items, prompts removed; the
rules and their parameters), which every score of a model trained on the pool cites.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_curation.ingest import normalize_text

__all__ = [
    "CONTAMINATION_SCHEMA",
    "CERTIFICATE_FILE",
    "ParaphraseParams",
    "TOKEN_RE",
    "decontaminate",
    "gram_table",
    "paraphrase_hits",
    "paraphrase_text",
]

CERTIFICATE_FILE = "certificate.json"

TOKEN_RE = r"[\p{L}\p{M}\p{N}_]+|[^\p{L}\p{M}\p{N}_\s]"

CONTAMINATION_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("source", pa.string()),
        ("benchmark", pa.string()),
        ("benchmark_problem_id", pa.string()),
        ("matched", pa.string()),
        ("overlap", pa.int64()),
        ("coverage", pa.float64()),
        ("rule", pa.string()),
        ("score", pa.float64()),
    ]
)


def gram_table(con, relation: str, name: str, ngram: int) -> None:
    """Create temp tables ``name_tokens(id, k, x)`` (1-based token positions) and ``name(id, pos, g)``:
    the n-gram hashes (BIGINT) of each text of ``relation(id, text)``, one per start position."""
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {name}_tokens AS
        WITH tok AS (SELECT id, regexp_extract_all(lower(text), '{TOKEN_RE}') AS t FROM {relation})
        SELECT id, unnest(generate_series(1, len(t))) AS k, unnest(t) AS x FROM tok
    """)
    window = ", ".join(["x"] + [f"lead(x, {i}) OVER w" for i in range(1, ngram)])
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE {name} AS
        WITH grams AS (  -- the gram starting at k: x and the next ngram - 1 tokens (NULL past the end)
            SELECT id, k, count(*) OVER (PARTITION BY id) AS m, hash({window}) AS h
            FROM {name}_tokens WINDOW w AS (PARTITION BY id ORDER BY k)
        )
        SELECT id, k AS pos, (h >> 1)::BIGINT AS g FROM grams WHERE k <= greatest(m - {ngram - 1}, 1)
    """)


_HITS_SQL = """
    WITH bench AS (SELECT DISTINCT id, g FROM _bgrams),
    shared AS (  -- prompt grams found in some benchmark item
        SELECT p.id AS pid, p.pos, p.g FROM _pgrams p WHERE p.g IN (SELECT g FROM bench)
    ), hits AS (
        SELECT s.pid, b.id AS bid, count(DISTINCT s.g) AS overlap, min(s.pos) AS first_pos
        FROM shared s JOIN bench b ON b.g = s.g GROUP BY s.pid, b.id
    ), starts AS (  -- where the shared grams start in the benchmark item
        SELECT DISTINCT s.pid, b.id AS bid, b.pos FROM (SELECT DISTINCT pid, g FROM shared) s
        JOIN _bgrams b ON b.g = s.g
    ), covered AS (
        SELECT pid, bid, unnest(generate_series(pos, pos + {n} - 1)) AS k FROM starts
    ), coverage AS (
        SELECT c.pid, c.bid, count(DISTINCT c.k)::DOUBLE / any_value(m.m) AS coverage
        FROM covered c JOIN (SELECT id, count(*) AS m FROM _bgrams_tokens GROUP BY id) m ON m.id = c.bid
        WHERE c.k <= m.m GROUP BY c.pid, c.bid
    ), kept AS (
        SELECT h.*, c.coverage FROM hits h JOIN coverage c ON c.pid = h.pid AND c.bid = h.bid
        WHERE c.coverage >= {min_coverage} - 1e-12
    ), matched AS (
        SELECT h.pid, h.bid, string_agg(t.x, ' ' ORDER BY t.k) AS matched
        FROM kept h JOIN _pgrams_tokens t
            ON t.id = h.pid AND t.k BETWEEN h.first_pos AND h.first_pos + {n} - 1
        GROUP BY h.pid, h.bid
    )
    SELECT pr.prompt_id, pr.source, it.benchmark, it.problem_id AS benchmark_problem_id, m.matched, h.overlap,
           h.coverage, h.pid
    FROM kept h JOIN matched m ON m.pid = h.pid AND m.bid = h.bid
    JOIN _prompts pr ON pr.id = h.pid JOIN _items it ON it.id = h.bid
    ORDER BY h.pid, h.bid
"""


# --------------------------------------------------------------------------- paraphrase rule

_ASY_RE = re.compile(r"\[asy\].*?(?:\[/asy\]|$)", re.S | re.I)
_STYLE_RE = re.compile(
    r"\\(?:math(?:cal|bf|rm|it|bb|sf|scr|frak|tt|op)|boldsymbol|bm|text(?:bf|it|rm|tt|sf|normal|style)?|mbox|hbox"
    r"|operatorname|emph|displaystyle|scriptstyle|left|right|[bB]ig{1,2}[lr]?|middle|quad|qquad|limits|nolimits)"
    r"(?![a-zA-Z])|\\[,;:! ]|\$|[{}]"
)
_MACRO_ALIASES = {
    r"\dfrac": r"\frac",
    r"\tfrac": r"\frac",
    r"\leq": r"\le",
    r"\geq": r"\ge",
    r"\neq": r"\ne",
    r"\dbinom": r"\binom",
    r"\tbinom": r"\binom",
    r"\lbrace": "",
    r"\rbrace": "",
    r"\ldots": "...",
    r"\cdots": "...",
    r"\dots": "...",
}
_ALIAS_RE = re.compile(
    "|".join(re.escape(k) for k in sorted(_MACRO_ALIASES, key=len, reverse=True)) + r"(?![a-zA-Z])"
)
_UNITS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_NUMBER_WORDS = {w: i for i, w in enumerate(_UNITS)} | {w: 10 * i for i, w in enumerate(_TENS) if w}
_NUMBER_RE = re.compile(
    r"\b("
    + "|".join(_TENS[2:])
    + r")(?:[- ]("
    + "|".join(_UNITS[1:10])
    + r"))?\b|\b("
    + "|".join(_UNITS)
    + r")\b"
)
_SINGLE_LETTER_RE = re.compile(r"(?<![A-Za-z\\])[A-Za-z](?![A-Za-z])")
STOPWORDS = frozenset(
    """
an and are as at be been being but by can could did do does for from had has have he her his how if in
into is it its of on or our she so such than that the their them then there these they this those to
was we were what when where which who whom whose why will with would you your let all any each also let's
""".split()
)
_WORD_RE = re.compile(r"[a-z']{2,}")
_SENTENCE_RE = re.compile(r"(?:(?<=[.?!:])|(?<=[.?!:]\$)|(?<=\$\$)|(?<=\\\])|(?<=\\\)))\s+|\n+")
"""Sentence ends for dropping instructions: after . ? ! : (also when math closes right after) and
after display math."""
_INSTRUCTION_RE = re.compile(
    r"step[- ]by[- ]step|final answer|\\boxed|on its own line|last line of your response"
    r"|answer to the problem|without quotes|helpful (?:math )?assistant"
    r"|(?:solve|answer) the following (?:math )?(?:problem|question)|the problem below",
    re.I,
)
_LABEL_RE = re.compile(r"^\s*(?:question|problem)\s*:\s*", re.I)
_ARTICLE_RE = re.compile(r"(?<![$\\\w])[aA]\s+(?=[a-zA-Z]{2,})")


def _number(m: re.Match) -> str:
    if m.group(3):
        return str(_NUMBER_WORDS[m.group(3)])
    return str(_NUMBER_WORDS[m.group(1)] + (_NUMBER_WORDS[m.group(2)] if m.group(2) else 0))


def paraphrase_text(text: str) -> str:
    """The text the paraphrase rule compares: NFKC-normalised, lowercased, ``[asy]`` figure code, ``$``,
    braces and style-only LaTeX (``\\mathcal``, ``\\text``, ``\\left``/``\\right``, spacing) removed,
    macro spellings unified (``\\dfrac`` = ``\\frac``), sentences of instructions to the solver
    ("... step by step", "... final answer within \\boxed{}", "Problem:") dropped, number words 0-99 as
    digits, every one-letter symbol as ``v`` (a renamed variable is the same symbol), articles and stop
    words dropped."""
    s = " ".join(
        _LABEL_RE.sub("", x)
        for x in _SENTENCE_RE.split(_ASY_RE.sub(" ", normalize_text(text)))
        if not _INSTRUCTION_RE.search(x)
    )
    s = _ARTICLE_RE.sub("", s)
    s = _ALIAS_RE.sub(lambda m: _MACRO_ALIASES[m.group()], s)
    s = _STYLE_RE.sub(" ", s).lower()
    s = _NUMBER_RE.sub(_number, s)
    s = _SINGLE_LETTER_RE.sub("v", s)
    s = _WORD_RE.sub(lambda m: "" if m.group() in STOPWORDS else m.group(), s)
    return " ".join(s.split())


@dataclass(frozen=True)
class ParaphraseParams:
    """The paraphrase rule's settings (``curation.decontam.paraphrase_*``; defaults measured by
    ``benchmarks/decontamination.py``, see docs/curation.md)."""

    high: float = 0.92
    """Flag a (prompt, item) pair whose score reaches this, whatever the answers."""
    moderate: float = 0.6
    """Flag a pair whose score reaches this when the prompt's canonical answer equals the item's."""
    ngram: int = 3
    """Skeleton n-gram length (numbers, symbols, LaTeX in order; words enter as a bag)."""
    num_perm: int = 128
    bands: int = 64
    seed: int = 0
    min_shingles: int = 6
    """An item with fewer shingles ("Compute 7!") is flagged by this rule only with the same answer."""
    min_words: int = 1
    """Items with fewer distinct content words (a bare expression, "What is 2+6+4?": no word is left
    but stop words) are left to the n-gram rule: their siblings share symbols and often the answer
    without being the same problem."""

    def validate(self) -> None:
        if not 0 < self.moderate <= self.high <= 1:
            raise ValueError(
                f"paraphrase thresholds need 0 < moderate ({self.moderate}) <= high ({self.high}) <= 1"
            )
        if self.ngram < 1:
            raise ValueError(f"paraphrase ngram must be >= 1, got {self.ngram}")
        if self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(
                f"paraphrase num_perm ({self.num_perm}) must be a positive multiple of bands ({self.bands})"
            )

    def describe(self) -> str:
        return (
            f"paraphrase(minhash-lsh {self.num_perm}/{self.bands}, skeleton {self.ngram}-grams, "
            f"score >= {self.high} or >= {self.moderate} with the same answer)"
        )


_PARA_SQL = """
    WITH inter AS (
        SELECT c.a, c.b, count(*) AS n
        FROM _para_cand c JOIN _psh x ON x.rid = c.a JOIN _psh y ON y.rid = c.b AND y.h = x.h
        GROUP BY c.a, c.b
    ), scored AS (
        SELECT i.a, i.b, i.n, i.n::DOUBLE / (sa.n + sb.n - i.n) AS jaccard, i.n::DOUBLE / sb.n AS containment,
               sa.n AS na, sb.n AS nb
        FROM inter i JOIN _psh_size sa ON sa.rid = i.a JOIN _psh_size sb ON sb.rid = i.b
    ), ranked AS (
        SELECT *, CASE WHEN na <= 2 * nb THEN greatest(jaccard, containment) ELSE jaccard END AS score
        FROM scored
    )
    SELECT pr.prompt_id, pr.source, it.benchmark, it.problem_id AS benchmark_problem_id,
           r.n AS overlap, r.score, (pr.answer = it.answer) AS same_answer, r.a AS pid
    FROM ranked r JOIN _para_prompts pr ON pr.rid = r.a JOIN _para_items it ON it.rid = r.b
    WHERE it.words >= {min_words} AND ((r.score >= {high} - 1e-12 AND r.nb >= {min_shingles})
       OR (r.score >= {moderate} - 1e-12 AND pr.answer = it.answer))
    ORDER BY r.a, r.b
"""


def _create_paraphrase_sides(con, prompts: pa.Table, items: pa.Table, normalised: list[str]) -> None:
    """Create temp tables ``_para_prompts`` (rid, prompt_id, source, answer) and ``_para_items`` (rid
    after the prompts', benchmark, problem_id, answer, words: distinct content words of the item's
    ``normalised`` text), and register ``_para_texts`` (rid, normalised text) for both sides."""
    n = prompts.num_rows
    con.register(
        "_para_prompts_arrow",
        pa.table(
            {
                "rid": prompts["rid"],
                "prompt_id": prompts["prompt_id"],
                "source": prompts["source"],
                "answer": prompts["answer"],
            }
        ),
    )
    con.execute("CREATE OR REPLACE TEMP TABLE _para_prompts AS SELECT * FROM _para_prompts_arrow")
    con.register(
        "_para_items_arrow",
        pa.table(
            {
                "rid": pa.array(range(n, n + items.num_rows), pa.int64()),
                "benchmark": items["benchmark"],
                "problem_id": items["problem_id"],
                "answer": items["answer"],
                "words": pa.array([len(set(_WORD_RE.findall(t))) for t in normalised[n:]], pa.int64()),
            }
        ),
    )
    con.execute("CREATE OR REPLACE TEMP TABLE _para_items AS SELECT * FROM _para_items_arrow")
    texts = pa.table(
        {"rid": pa.array(range(n + items.num_rows), pa.int64()), "text": pa.array(normalised, pa.string())}
    )
    con.register("_para_texts", texts)


def _create_paraphrase_candidates(con, n_prompts: int, params: ParaphraseParams) -> None:
    """Create temp table ``_para_cand(a, b)``: the (prompt, item) rid pairs of ``_para_texts`` that
    share an LSH band, and leave the shingles in ``_psh``."""
    from data_curation.dedup import lsh_band_keys, lsh_band_table, shingle_signatures, shingle_table

    shingle_table(con, "_para_texts", params.ngram, name="_psh")
    rows, sig = shingle_signatures(con, "_psh", params.num_perm, params.seed)
    keys = lsh_band_keys(sig, params.bands, max_bucket=1 << 62)  # cross pairs only: no crowding refinement
    con.register("_para_bands_arrow", lsh_band_table(rows, keys))
    con.execute(f"""
        CREATE OR REPLACE TEMP TABLE _para_cand AS
        WITH b AS (SELECT * FROM _para_bands_arrow)
        SELECT DISTINCT x.rid AS a, y.rid AS b FROM b x JOIN b y ON x.band = y.band AND x.bh = y.bh
        WHERE x.rid < {n_prompts} AND y.rid >= {n_prompts}
    """)


def paraphrase_hits(con, prompts: pa.Table, items: pa.Table, params: ParaphraseParams) -> pa.Table:
    """(prompt, benchmark item) pairs the paraphrase rule flags. ``prompts``: rid (0..n-1), prompt_id,
    source, text (raw problem), answer; ``items``: benchmark, problem_id, text, answer.

    Both sides go through :func:`paraphrase_text`, then ``dedup.shingle_table`` (a bag of words plus
    ordered skeleton ``ngram``-grams). MinHash signatures and LSH bands (``dedup``) give candidate
    pairs, one prompt and one item sharing a band, joined in DuckDB; every candidate is verified on
    the exact shingle sets: score = max(Jaccard, containment of the item's shingles in the prompt's)
    (containment only when the prompt has at most twice the item's shingles, so an added instruction
    wrapper does not hide a copy while a long problem cannot swallow a short one)."""
    params.validate()
    normalised = [paraphrase_text(t or "") for t in prompts["text"].to_pylist() + items["text"].to_pylist()]
    _create_paraphrase_sides(con, prompts, items, normalised)
    _create_paraphrase_candidates(con, prompts.num_rows, params)
    for name in ("_para_prompts_arrow", "_para_items_arrow", "_para_texts", "_para_bands_arrow"):
        con.unregister(name)
    return con.sql(
        _PARA_SQL.format(
            high=float(params.high),
            moderate=float(params.moderate),
            min_shingles=int(params.min_shingles),
            min_words=int(params.min_words),
        )
    ).to_arrow_table()


def _items_table(benchmark_items: Iterable) -> pa.Table:
    seen, rows = set(), {"id": [], "benchmark": [], "problem_id": [], "text": [], "answer": []}
    for item in benchmark_items:
        key = (str(item.benchmark), str(item.problem_id))
        if key in seen:
            continue
        seen.add(key)
        rows["id"].append(len(seen) - 1)
        rows["benchmark"].append(key[0])
        rows["problem_id"].append(key[1])
        rows["text"].append(normalize_text(str(item.problem)))
        answer = getattr(item, "answer", None)
        rows["answer"].append(None if answer is None else str(answer))
    types = {
        "id": pa.int64(),
        "benchmark": pa.string(),
        "problem_id": pa.string(),
        "text": pa.string(),
        "answer": pa.string(),
    }
    return pa.table({k: pa.array(v, types[k]) for k, v in rows.items()})


def _check_rules(ngram: int, min_coverage: float, paraphrase: ParaphraseParams | None) -> None:
    if ngram < 1:
        raise ValueError(f"ngram must be >= 1, got {ngram}")
    if not 0 < min_coverage <= 1:
        raise ValueError(f"min_coverage must be in (0, 1], got {min_coverage}")
    if paraphrase is not None:
        paraphrase.validate()


def _read_prompts(prompts_path: Path) -> pa.Table:
    prompts = pq.read_table(prompts_path)
    missing = {"prompt_id", "problem"} - set(prompts.column_names)
    if missing:
        raise ValueError(
            f"{prompts_path} lacks column(s) {sorted(missing)}; expected ingest's prompts.parquet"
        )
    return prompts


def _column_or_nulls(table: pa.Table, name: str) -> pa.ChunkedArray | pa.Array:
    """Column ``name`` of ``table``, or string nulls where the table has none."""
    return table[name] if name in table.column_names else pa.nulls(table.num_rows, pa.string())


def _ngram_hits(con, prompts: pa.Table, items: pa.Table, ngram: int, min_coverage: float) -> pa.Table:
    """The (prompt, item) pairs the n-gram rule flags, as contamination rows with ``pid`` (the
    prompt's row number), ordered by pid, then item."""
    texts = pa.table(
        {
            "id": pa.array(range(prompts.num_rows), pa.int64()),
            "prompt_id": prompts["prompt_id"],
            "source": _column_or_nulls(prompts, "source"),
            "text": pa.array([normalize_text(p or "") for p in prompts["problem"].to_pylist()], pa.string()),
        }
    )
    con.register("_prompts", texts)
    con.register("_items", items)
    gram_table(con, "_items", "_bgrams", ngram)
    gram_table(con, "_prompts", "_pgrams", ngram)
    hits = con.sql(_HITS_SQL.format(n=ngram, min_coverage=float(min_coverage))).to_arrow_table()
    return hits.append_column("rule", pa.array(["ngram"] * hits.num_rows, pa.string())).append_column(
        "score", hits["coverage"]
    )


def _paraphrase_contamination(
    con, prompts: pa.Table, items: pa.Table, ngram_hits: pa.Table, params: ParaphraseParams
) -> pa.Table:
    """The pairs the paraphrase rule flags among the prompts ``ngram_hits`` leaves, as contamination
    rows of ``ngram_hits``' schema."""
    flagged = set(ngram_hits["pid"].to_pylist())
    rest = pa.array([i for i in range(prompts.num_rows) if i not in flagged], pa.int64())
    sub = pa.table(
        {
            "rid": pa.array(range(len(rest)), pa.int64()),
            "prompt_id": prompts["prompt_id"].take(rest),
            "source": _column_or_nulls(prompts, "source").take(rest),
            "text": prompts["problem"].take(rest),
            "answer": _column_or_nulls(prompts, "answer").take(rest).cast(pa.string()),
        }
    )
    hits = paraphrase_hits(con, sub, items, params)
    pid = pa.array(rest.to_numpy()[hits["pid"].to_numpy()] if hits.num_rows else [], pa.int64())
    rule = ["paraphrase" if not s else "paraphrase+answer" for s in _answer_needed(hits, params)]
    return (
        pa.table(
            {
                "prompt_id": hits["prompt_id"],
                "source": hits["source"],
                "benchmark": hits["benchmark"],
                "benchmark_problem_id": hits["benchmark_problem_id"],
                "matched": pa.nulls(hits.num_rows, pa.string()),
                "overlap": hits["overlap"],
                "coverage": pa.nulls(hits.num_rows, pa.float64()),
                "pid": pid,
                "rule": pa.array(rule, pa.string()),
                "score": hits["score"],
            }
        )
        .select(ngram_hits.column_names)
        .cast(ngram_hits.schema)
    )


def _contamination(
    prompts: pa.Table, items: pa.Table, ngram: int, min_coverage: float, paraphrase: ParaphraseParams | None
) -> pa.Table:
    """Every (prompt, item) pair either rule flags, with ``pid`` (the prompt's row number), ordered by
    pid, benchmark and item id."""
    from data_curation.db import memory_db

    con = memory_db()
    try:
        ngram_hits = _ngram_hits(con, prompts, items, ngram, min_coverage)
        parts = [ngram_hits]
        if paraphrase is not None and items.num_rows:
            parts.append(_paraphrase_contamination(con, prompts, items, ngram_hits, paraphrase))
        return pa.concat_tables(parts).sort_by(
            [("pid", "ascending"), ("benchmark", "ascending"), ("benchmark_problem_id", "ascending")]
        )
    finally:
        con.close()


def _write_tables(prompts: pa.Table, contamination: pa.Table, dirty: np.ndarray, out_dir: Path) -> None:
    """``prompts.parquet`` without the ``dirty`` rows and ``contamination.parquet`` in ``out_dir``."""
    keep = np.ones(prompts.num_rows, dtype=bool)
    keep[dirty] = False
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(prompts.filter(pa.array(keep)), out_dir / "prompts.parquet", compression="zstd")
    pq.write_table(
        contamination.drop_columns(["pid"]).cast(CONTAMINATION_SCHEMA),
        out_dir / "contamination.parquet",
        compression="zstd",
    )


def _counts(prompts_in: int, dirty: np.ndarray, contamination: pa.Table) -> dict[str, float]:
    """Prompts in, clean and contaminated, and contaminated by the n-gram rule or by the paraphrase rule
    alone."""
    rules_by_pid: dict[int, set] = {}
    for p, r in zip(contamination["pid"].to_pylist(), contamination["rule"].to_pylist()):
        rules_by_pid.setdefault(p, set()).add(r)
    return {
        "prompts_in": float(prompts_in),
        "clean": float(prompts_in - len(dirty)),
        "contaminated": float(len(dirty)),
        "contaminated_ngram": float(sum(1 for r in rules_by_pid.values() if "ngram" in r)),
        "contaminated_paraphrase": float(sum(1 for r in rules_by_pid.values() if "ngram" not in r)),
    }


def _removed_by_benchmark(contamination: pa.Table, items: pa.Table) -> dict[str, int]:
    """Per benchmark among ``items``, in name order: the prompts it contaminates."""
    pairs = set(zip(contamination["pid"].to_pylist(), contamination["benchmark"].to_pylist()))
    return {
        bench: sum(1 for _, b in pairs if b == bench) for bench in sorted(set(items["benchmark"].to_pylist()))
    }


def _certificate(
    prompts_in: int,
    items: pa.Table,
    removed: dict[str, int],
    ngram: int,
    min_coverage: float,
    paraphrase: ParaphraseParams | None,
    benchmark_hashes: dict[str, str] | None,
) -> dict:
    """``certificate.json``'s content (see the module docstring)."""
    rules = [f"ngram(n={ngram}, min_coverage={min_coverage})"] + (
        [paraphrase.describe()] if paraphrase else []
    )
    return {
        "rules": rules,
        "params": {
            "ngram": ngram,
            "min_coverage": min_coverage,
            "paraphrase": asdict(paraphrase) if paraphrase else None,
        },
        "prompts_in": prompts_in,
        "benchmarks": {
            bench: {
                "sha256": (benchmark_hashes or {}).get(bench),
                "items": items["benchmark"].to_pylist().count(bench),
                "removed": n,
            }
            for bench, n in removed.items()
        },
    }


def decontaminate(
    prompts_path: Path,
    benchmark_items: Iterable,
    out_dir: Path,
    *,
    ngram: int = 13,
    min_coverage: float = 0.7,
    paraphrase: ParaphraseParams | None = ParaphraseParams(),
    benchmark_hashes: dict[str, str] | None = None,
) -> dict[str, float]:
    """Drop the prompts of ``prompts_path`` (an ingest ``prompts.parquet``) that cover at least
    ``min_coverage`` of a benchmark item's tokens with shared ``ngram``-grams (rule ``ngram``), then,
    among the rest, those the paraphrase rule flags (rule ``paraphrase``, :func:`paraphrase_hits`;
    ``paraphrase=None`` turns it off). ``benchmark_items`` are objects with ``benchmark``,
    ``problem_id``, ``problem`` and ``answer`` (canonical, as ``normalize_answer`` gives it).
    See the module docstring. Writes ``certificate.json``: per benchmark, the hash of the file
    checked against (``benchmark_hashes``; None when not given), the rules and the prompts removed.
    Returns counts: prompts_in, clean, contaminated, contaminated_ngram, contaminated_paraphrase and
    contaminated_<benchmark> (prompts hit by that benchmark) for every benchmark among the items."""
    import json

    _check_rules(ngram, min_coverage, paraphrase)
    prompts = _read_prompts(prompts_path)
    items = _items_table(benchmark_items)
    contamination = _contamination(prompts, items, ngram, min_coverage, paraphrase)
    dirty = np.unique(contamination["pid"].to_numpy())
    out_dir = Path(out_dir)
    _write_tables(prompts, contamination, dirty, out_dir)
    removed = _removed_by_benchmark(contamination, items)
    counts = _counts(prompts.num_rows, dirty, contamination)
    counts.update({f"contaminated_{bench}": float(n) for bench, n in removed.items()})
    certificate = _certificate(
        prompts.num_rows, items, removed, ngram, min_coverage, paraphrase, benchmark_hashes
    )
    with open(out_dir / CERTIFICATE_FILE, "w") as f:
        json.dump(certificate, f, indent=1, sort_keys=True)
    return counts


def _answer_needed(hits: pa.Table, params: ParaphraseParams) -> list[bool]:
    """Per flagged pair: True when only the same answer let its moderate score through."""
    return [s < params.high - 1e-12 for s in hits["score"].to_pylist()]
