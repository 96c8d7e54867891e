"""Ingest prompt pools: read each source, normalise it, quarantine bad rows, drop duplicates.

``ingest`` turns a list of ``SourceSpec`` into four parquet tables in ``out_dir``:

- ``prompts.parquet``: prompt_id, source, source_row, problem (``normalize_text``), answer
  (``normalize_answer``), level (Int32), subject, text_hash (see ``dedup.DEDUP_KEY_SQL``), then every
  extra field (Utf8); in source order, then source_row. ``prompt_id`` and ``text_hash`` are unique.
- ``quarantine.parquet``: source, source_row, raw (the line or record as text, at most 2,000
  characters), reason.
- ``duplicates.parquet``: source, source_row, prompt_id, canonical_id (the kept row), kind
  ("exact" | "near"), similarity (1.0 for exact; the exact shingle Jaccard for near).
- ``templates.parquet``: source, template (``prefix{problem}suffix``), prefix, suffix, rows, matched:
  the instruction wrapper most of a source's rows shared, taken out of ``problem``
  (``data_curation.templates``); no row for a source without one.

Every input row ends in exactly one of them: rows_in == ingested + quarantined + duplicates.

A row moves through: parse (bad JSON, undecodable bytes, not an object) -> fields (missing or empty
problem / answer, non-string problem, a problem longer than ``max_prompt_chars``, a level outside
the int32 level column, missing id) -> the source's shared wrapper out -> ids (a prompt_id already
taken by an earlier row, when ids come from ``id_field``) -> exact dedup -> near dedup
(``data_curation.dedup``; by default only between prompts with the same canonical answer).
Duplicates keep the earliest row (source order, then source_row), across sources too. The id and
dedup steps run as DuckDB SQL.

``prompt_id`` is ``str(record[id_field])`` when the source has ids, else
``f"{source}-{sha256(problem)[:16]}"`` over the normalised problem.

``source_row`` is the 0-based line number for JSON lines and the 0-based record index otherwise;
the files of a folder are read in name order and numbered consecutively.

A row never stops ingest; a file that cannot be read at all (not parquet, not UTF-8 JSON, a
permission error) raises :class:`SourceError`, whose one-line message names the source, the file and
the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from conf.schema import SOURCE_FORMATS, VERIFIABILITY, DataConfig, SourceFormat, Verifiability
from core.errors import StageError
from data_curation.dedup import NearDupParams, exact_duplicates, near_duplicates
from data_curation.templates import MIN_SHARE as TEMPLATE_SHARE
from data_curation.templates import Template, detect_template, strip_template
from data_curation.verifiability import UNVERIFIABLE, UNVERIFIABLE_KINDS, grade_answer
from environments.code import CodeSpec
from rewards.verifier import normalize_answer

__all__ = [
    "DUPLICATES_SCHEMA",
    "QUARANTINE_SCHEMA",
    "TEMPLATES_SCHEMA",
    "SourceError",
    "SourceSpec",
    "ingest",
    "normalize_text",
    "prompts_schema",
    "read_source",
    "resolve_format",
    "unverifiable_counts",
]

RAW_MAX_CHARS = 2000
MAX_PROMPT_CHARS = DataConfig().max_prompt_chars
"""The default limit on a problem's length (``data.max_prompt_chars``; see the schema for why)."""
LEVEL_MIN, LEVEL_MAX = -(2**31), 2**31 - 1
"""Levels are stored as int32; a level outside is quarantined ("level out of range")."""
CORE_COLUMNS = ("prompt_id", "source", "source_row", "problem", "answer", "level", "subject", "text_hash")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}

QUARANTINE_SCHEMA = pa.schema(
    [("source", pa.string()), ("source_row", pa.int64()), ("raw", pa.string()), ("reason", pa.string())]
)
TEMPLATES_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("template", pa.string()),
        ("prefix", pa.string()),
        ("suffix", pa.string()),
        ("rows", pa.int64()),
        ("matched", pa.int64()),
    ]
)
DUPLICATES_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("source_row", pa.int64()),
        ("prompt_id", pa.string()),
        ("canonical_id", pa.string()),
        ("kind", pa.string()),
        ("similarity", pa.float64()),
    ]
)


class SourceError(StageError, ValueError):
    """A source file that cannot be read at all; the message (one line) names the source, the file
    and the reason."""


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[:limit] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def _reading(spec: SourceSpec, file: Path, what: str) -> Iterator[None]:
    """Turn any failure to read ``file`` into one :class:`SourceError` line (no traceback chain)."""
    try:
        yield
    except SourceError:
        raise
    except (OSError, ValueError, RecursionError, pa.ArrowException) as exc:
        raise SourceError(f"source {spec.name!r}: cannot read {file} as {what} ({_one_line(exc)})") from None


@dataclass(frozen=True)
class SourceSpec:
    """One prompt pool and how its fields map. Field names may be dotted paths into nested
    records (``"reward_model.ground_truth"``); a key that contains the dot itself wins."""

    name: str
    path: str
    format: SourceFormat = "auto"
    problem_field: str = "problem"
    answer_field: str = "answer"
    id_field: str | None = None
    level_field: str | None = None
    subject_field: str | None = None
    extra_fields: tuple[str, ...] = ()
    split: str = "train"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SourceSpec.name must be a non-empty label, e.g. 'math_train'")
        if self.format not in SOURCE_FORMATS:
            raise ValueError(
                f"source {self.name!r}: format={self.format!r} is not one of {', '.join(SOURCE_FORMATS)}"
            )
        object.__setattr__(self, "extra_fields", tuple(self.extra_fields))
        clash = sorted(set(self.extra_fields) & set(CORE_COLUMNS))
        if clash:
            raise ValueError(
                f"source {self.name!r}: extra_fields {clash} clash with the prompts table's own "
                f"columns {CORE_COLUMNS}; drop them from extra_fields"
            )


# --------------------------------------------------------------------------- normalisation

_HSPACE = re.compile(r"[^\S\n]+")
_LINE_EDGES = re.compile(r" ?\n ?")


def normalize_text(s: str) -> str:
    """NFKC, line endings to ``\\n``, runs of other whitespace to one space, no spaces at line
    edges, stripped. Line structure (including blank lines) is kept."""
    s = unicodedata.normalize("NFKC", s).replace("\r\n", "\n").replace("\r", "\n")
    return _LINE_EDGES.sub("\n", _HSPACE.sub(" ", s)).strip()


def _lookup(record: Mapping[str, Any], field: str) -> tuple[bool, Any]:
    if field in record:
        return True, record[field]
    value: Any = record
    for part in field.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


_LEVEL_RE = re.compile(r"([+-]?)0*(\d+)(?:\.\d+)?")


def _level(value: Any) -> int | float | None:
    """An integer level from 3, 3.0, "3" or "Level 3"; None when there is none (or NaN). May lie
    outside ``LEVEL_MIN..LEVEL_MAX`` (``±inf`` for one too long to convert): the caller checks."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isinf(value) else int(round(value))
    m = _LEVEL_RE.search(value if isinstance(value, str) else _text(value) or "")
    if m is None:
        return None
    if len(m.group(2)) > 18:  # far out of range; float() of 400 digits is inf, round(inf) raises
        return -math.inf if m.group(1) == "-" else math.inf
    return int(round(float(m.group())))


def _show(value: Any, limit: int = 40) -> str:
    """A value for a quarantine reason, cut to ``limit`` characters (with its full length)."""
    try:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    except ValueError:  # an int beyond Python's 4,300-digit str() limit
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _text(value: Any) -> str | None:
    """An extra field as text: strings unchanged, containers as JSON, None as null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return str(value)


def _raw(record: Any) -> str:
    try:
        text = record if isinstance(record, str) else json.dumps(record, ensure_ascii=False, default=str)
    except (ValueError, RecursionError) as exc:  # an int past Python's str() limit, a cyclic record
        text = f"(record not printable: {_one_line(exc, 200)})"
    return text[:RAW_MAX_CHARS]


# --------------------------------------------------------------------------- readers
# Each reader yields (source_row, record, raw, reason): a parsed mapping with raw=reason=None, or
# record=None with the raw text and why it was rejected.

Row = tuple[int, "Mapping[str, Any] | None", "str | None", "str | None"]


def _files(path: Path, fmt: str) -> list[Path]:
    if path.is_file():
        return [path]
    suffix = next(s for s, f in SUFFIX_FORMATS.items() if f == ("parquet" if fmt == "verl" else fmt))
    files = sorted(p for p in path.rglob(f"*{suffix}") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no *{suffix} files under {path}")
    return files


def _objects(items: Sequence[Any], start: int) -> Iterator[Row]:
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            yield start + i, item, None, None
        else:
            yield start + i, None, _raw(item), f"not an object ({type(item).__name__})"


def _read_jsonl(spec: SourceSpec, path: Path) -> Iterator[Row]:
    row = -1
    for file in _files(path, "jsonl"):
        with _reading(spec, file, "JSON lines"), file.open("rb") as f:
            for i, line in enumerate(f):
                row += 1
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8-sig" if i == 0 else "utf-8")
                except UnicodeDecodeError:
                    yield row, None, _raw(line.decode("utf-8", "replace").rstrip("\r\n")), "undecodable bytes"
                    continue
                try:
                    obj = json.loads(text)
                except (ValueError, RecursionError) as exc:  # also >4,300-digit ints, deep nesting
                    yield row, None, _raw(text.rstrip("\r\n")), f"bad json: {_one_line(exc, 200)}"
                    continue
                yield from _objects([obj], row)


def _read_json(spec: SourceSpec, path: Path) -> Iterator[Row]:
    offset = 0
    for file in _files(path, "json"):
        with _reading(spec, file, "JSON"):
            raw = file.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise SourceError(
                f"source {spec.name!r}: {file} is not a UTF-8 JSON document ({_one_line(exc)}); "
                "for one object per line use format='jsonl'"
            ) from None
        if isinstance(data, Mapping) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise SourceError(
                f'source {spec.name!r}: {file} must hold a list of objects or {{"data": [...]}}, '
                f"got a {type(data).__name__}"
            )
        yield from _objects(data, offset)
        offset += len(data)


def _read_parquet(spec: SourceSpec, path: Path) -> Iterator[Row]:
    offset = 0
    for file in _files(path, "parquet"):
        with _reading(spec, file, "parquet"):
            records = pq.read_table(file).to_pylist()
        yield from _objects(records, offset)
        offset += len(records)


def _verl_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A verl row with ``problem`` (the last user message's content) and ``answer``
    (``reward_model.ground_truth``) added; its other fields stay reachable."""
    messages, problem = record.get("prompt"), None
    if isinstance(messages, str):
        problem = messages
    elif isinstance(messages, (list, tuple)):
        for m in reversed(messages):
            if isinstance(m, Mapping) and m.get("role") == "user":
                problem = m.get("content")
                break
    found, answer = _lookup(record, "reward_model.ground_truth")
    if isinstance(answer, (list, tuple)) and len(answer) == 1:
        answer = answer[0]
    return {**record, "problem": problem, "answer": answer if found else None}


def _read_verl(spec: SourceSpec, path: Path) -> Iterator[Row]:
    for row, record, raw, reason in _read_parquet(spec, path):
        yield row, (_verl_record(record) if record is not None else None), raw, reason


def _load_hf(spec: SourceSpec):
    import datasets

    path = Path(spec.path)
    if path.is_dir() and any((path / m).exists() for m in HF_MARKERS):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if spec.split not in ds:
                raise ValueError(f"source {spec.name!r}: split {spec.split!r} not in {sorted(ds)} at {path}")
            ds = ds[spec.split]
        return ds
    if path.is_file():
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
        if builder is None:
            raise ValueError(
                f"source {spec.name!r}: cannot load {path} with datasets; use a .jsonl, .json, "
                ".parquet or .csv file or a save_to_disk folder"
            )
        return datasets.load_dataset(builder, data_files={spec.split: str(path)}, split=spec.split)
    return datasets.load_dataset(spec.path, split=spec.split)  # a data folder, or a hub dataset name


def _read_hf(spec: SourceSpec, path: Path) -> Iterator[Row]:
    try:
        records = _load_hf(spec).to_list()
    except SourceError:
        raise
    except Exception as exc:  # datasets' many error types: one line naming the source
        raise SourceError(
            f"source {spec.name!r}: cannot load {spec.path} with datasets ({_one_line(exc)})"
        ) from None
    yield from _objects(records, 0)


def _code_record(spec: SourceSpec, record: Mapping[str, Any]) -> dict[str, Any]:
    """A code row with ``answer`` set to its ``CodeSpec`` (JSON): ``tests`` (a string or a list of
    strings), ``entry_point`` and ``prefix`` taken from the record exactly (indentation matters);
    None when the tests are missing or malformed (the row is then quarantined as "missing answer")."""
    try:
        raw = {k: record.get(k) for k in ("tests", "entry_point", "prefix")}
        answer = CodeSpec.from_answer(json.dumps(raw)).to_answer()
    except (TypeError, ValueError):
        answer = None
    return {**record, "answer": answer}


def _read_code(spec: SourceSpec, path: Path) -> Iterator[Row]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SUFFIX_FORMATS)
    if not files:
        raise FileNotFoundError(f"no .jsonl, .json or .parquet files under {path}")
    reader = _READERS[SUFFIX_FORMATS.get(files[0].suffix, "jsonl")]
    for row, record, raw, reason in reader(spec, path):
        yield row, (_code_record(spec, record) if record is not None else None), raw, reason


_READERS: dict[str, Callable[[SourceSpec, Path], Iterator[Row]]] = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "parquet": _read_parquet,
    "hf": _read_hf,
    "verl": _read_verl,
    "code": _read_code,
}


def _is_verl(spec: SourceSpec, file: Path) -> bool:
    with _reading(spec, file, "parquet"):
        names = set(pq.read_schema(file).names)
    return {"prompt", "reward_model"} <= names


def resolve_format(spec: SourceSpec) -> str:
    """The concrete format of ``spec``: its own, or for ``auto`` by suffix (a folder: by what it
    holds; a parquet file with ``prompt`` and ``reward_model`` columns is verl)."""
    if spec.format != "auto":
        return spec.format
    path = Path(spec.path)
    if not path.exists():
        raise FileNotFoundError(
            f"source {spec.name!r}: {path} does not exist (a hub dataset needs format='hf')"
        )
    if path.is_dir():
        if any((path / m).exists() for m in HF_MARKERS):
            return "hf"
        found = {
            SUFFIX_FORMATS[p.suffix] for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIX_FORMATS
        }
        if len(found) != 1:
            raise ValueError(
                f"source {spec.name!r}: folder {path} holds {sorted(found) or 'no'} data files; it "
                "needs files of exactly one of .jsonl, .json, .parquet, or set format=..."
            )
        fmt = found.pop()
        first = _files(path, fmt)[0]
    else:
        fmt = SUFFIX_FORMATS.get(path.suffix)
        if fmt is None:
            raise ValueError(
                f"source {spec.name!r}: cannot tell the format of {path} from its suffix; "
                f"set format to one of {', '.join(SOURCE_FORMATS[1:])}"
            )
        first = path
    return "verl" if fmt == "parquet" and _is_verl(spec, first) else fmt


def check_readable(spec: SourceSpec) -> int | None:
    """What can fail before anything is written (``tasks.preflight``): the format resolves and each
    file parses as it (a JSON document whole, a parquet file's footer; JSON lines are read line by
    line, a bad line is only quarantined). Returns the rows the source holds (for JSON lines: its
    non-blank lines), None for a ``hf`` source (loading it is the stage's work). Raises
    :class:`SourceError`, ``FileNotFoundError`` or ``ValueError`` with a one-line message."""
    fmt = resolve_format(spec)
    path = Path(spec.path)
    if fmt == "hf":
        return None
    if fmt == "code":
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in SUFFIX_FORMATS)
        fmt = SUFFIX_FORMATS.get(files[0].suffix, "jsonl") if files else "jsonl"
    rows = 0
    for file in _files(path, "parquet" if fmt == "verl" else fmt):
        if fmt == "json":
            rows += sum(1 for _ in _read_json(spec, file))
        elif fmt in ("parquet", "verl"):
            with _reading(spec, file, "parquet"):
                rows += pq.read_metadata(file).num_rows
        else:
            with _reading(spec, file, "JSON lines"), file.open("rb") as f:
                rows += sum(1 for line in f if line.strip())
    return rows


def empty_pool_error(rows_in: int, reasons: Iterable[str]) -> str:
    """The one line an empty pool stops with: how many rows came in and why none was kept."""
    counts: dict[str, int] = {}
    for reason in reasons:
        kind = reason.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    why = ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
    what = (
        f"none of its {int(rows_in)} rows was ingested (quarantined: {why}); fix the sources"
        if rows_in
        else "its sources hold no rows; fix the sources"
    )
    return (
        f"the prompt pool is empty: {what} or pass --allow-empty (data.allow_empty=true) to go on "
        "with an empty pool"
    )


def read_source(spec: SourceSpec) -> tuple[list[dict], list[dict]]:
    """Parse one source. Returns (rows, quarantined): rows are ``{"source_row", "record"}`` with the
    parsed record (for verl, with ``problem`` and ``answer`` added); quarantined rows are
    ``{"source", "source_row", "raw", "reason"}`` for lines that are not JSON objects."""
    fmt = resolve_format(spec)
    path = Path(spec.path)
    if fmt != "hf" and not path.exists():
        raise FileNotFoundError(f"source {spec.name!r}: {path} does not exist")
    rows, quarantined = [], []
    for source_row, record, raw, reason in _READERS[fmt](spec, path):
        if record is None:
            quarantined.append({"source": spec.name, "source_row": source_row, "raw": raw, "reason": reason})
        else:
            rows.append({"source_row": source_row, "record": record})
    return rows, quarantined


# --------------------------------------------------------------------------- fields


def _fields(
    spec: SourceSpec,
    record: Mapping[str, Any],
    max_prompt_chars: int = MAX_PROMPT_CHARS,
    verifiability: Verifiability = "short_form",
) -> dict[str, Any] | str:
    """The prompt fields of one record, or the reason it is quarantined."""
    found, problem = _lookup(record, spec.problem_field)
    if not found or problem is None:
        return "missing problem"
    if not isinstance(problem, str):
        return "non-string problem"
    problem = normalize_text(problem)
    if not problem:
        return "empty problem"
    if len(problem) > max_prompt_chars:
        return f"problem too long ({len(problem):,} characters > data.max_prompt_chars={max_prompt_chars:,})"
    if spec.format == "code":
        answer = record.get("answer")
        if not answer:
            return "missing answer"
        return _ids_and_rest(spec, record, problem, answer)
    found, answer = _lookup(record, spec.answer_field)
    if not found or answer is None or (isinstance(answer, float) and not math.isfinite(answer)):
        return "missing answer"
    if not isinstance(answer, (str, int, float)):
        return "non-scalar answer"
    answer = normalize_text(answer) if isinstance(answer, str) else answer
    if not normalize_answer(answer):
        return "empty answer"
    if verifiability == "short_form":
        graded = grade_answer(answer)
        if graded is not None:
            return graded.reason
    return _ids_and_rest(spec, record, problem, normalize_answer(answer))


def _ids_and_rest(
    spec: SourceSpec, record: Mapping[str, Any], problem: str, answer: str
) -> dict[str, Any] | str:
    """The id, level, subject and extra fields of a row whose problem and answer passed."""
    if spec.id_field:
        found, value = _lookup(record, spec.id_field)
        if not found or value is None or not str(value).strip():
            return "missing id"
        prompt_id = str(value)
    else:
        prompt_id = f"{spec.name}-{hashlib.sha256(problem.encode()).hexdigest()[:16]}"
    level = None
    if spec.level_field:
        raw_level = _lookup(record, spec.level_field)[1]
        level = _level(raw_level)
        if level is not None and not LEVEL_MIN <= level <= LEVEL_MAX:
            return f"level out of range ({_show(raw_level)}; levels are integers in {LEVEL_MIN}..{LEVEL_MAX})"
    subject = _text(_lookup(record, spec.subject_field)[1]) if spec.subject_field else None
    extras = {f: _text(_lookup(record, f)[1]) for f in spec.extra_fields}
    return {
        "prompt_id": prompt_id,
        "id_explicit": bool(spec.id_field),
        "problem": problem,
        "answer": answer,
        "level": level,
        "subject": subject,
        **extras,
    }


def prompts_schema(extra_fields: Sequence[str]) -> pa.Schema:
    return pa.schema(
        [
            ("prompt_id", pa.string()),
            ("source", pa.string()),
            ("source_row", pa.int64()),
            ("problem", pa.string()),
            ("answer", pa.string()),
            ("level", pa.int32()),
            ("subject", pa.string()),
            ("text_hash", pa.string()),
            *[(f, pa.string()) for f in extra_fields],
        ]
    )


# --------------------------------------------------------------------------- ingest


def _collect(
    sources: Sequence[SourceSpec],
    extra_fields: list[str],
    max_prompt_chars: int = MAX_PROMPT_CHARS,
    template_share: float | None = TEMPLATE_SHARE,
    verifiability: Verifiability = "short_form",
):
    """Read and validate every source, taking out the instruction wrapper its rows share (when
    ``template_share`` is not None; see ``data_curation.templates``). Returns (columns of the
    accepted rows, their records, quarantine rows with their source index, per-source counts,
    templates by source)."""
    names = (
        "rid",
        "source",
        "source_row",
        "prompt_id",
        "id_explicit",
        "problem",
        "answer",
        "level",
        "subject",
    )
    cols: dict[str, list] = {k: [] for k in (*names, *extra_fields)}
    records: list[Mapping[str, Any]] = []
    quarantine: list[tuple[int, dict]] = []
    per_source: dict[str, float] = {}
    templates: dict[str, Template] = {}
    for si, spec in enumerate(sources):
        rows, bad = read_source(spec)
        per_source[f"rows_in_{spec.name}"] = float(len(rows) + len(bad))
        quarantine += [(si, q) for q in bad]
        accepted, refused = _validated(spec, rows, max_prompt_chars, verifiability)
        quarantine += [(si, q) for q in refused]
        found = _strip_template(spec, [f for _, f in accepted], template_share)
        if found is not None:
            templates[spec.name] = found
        for row, fields in accepted:
            cols["rid"].append(len(records))
            cols["source"].append(spec.name)
            cols["source_row"].append(row["source_row"])
            for k in ("prompt_id", "id_explicit", "problem", "answer", "level", "subject"):
                cols[k].append(fields[k])
            for f in extra_fields:
                cols[f].append(fields.get(f))
            records.append(row["record"])
    return cols, records, quarantine, per_source, templates


def _validated(
    spec: SourceSpec, rows: list[dict], max_prompt_chars: int, verifiability: Verifiability
) -> tuple[list[tuple[dict, dict]], list[dict]]:
    """(accepted (row, fields) pairs, quarantine rows) of one source's parsed ``rows`` (``_fields``)."""
    accepted, refused = [], []
    for row in rows:
        fields = _fields(spec, row["record"], max_prompt_chars, verifiability)
        if isinstance(fields, str):
            refused.append(
                {
                    "source": spec.name,
                    "source_row": row["source_row"],
                    "raw": _raw(row["record"]),
                    "reason": fields,
                }
            )
        else:
            accepted.append((row, fields))
    return accepted, refused


def _strip_template(spec: SourceSpec, fields: list[dict], template_share: float | None) -> Template | None:
    """The instruction wrapper shared by at least ``template_share`` of a source's accepted rows
    (``fields``), taken out of their problems in place (a derived id follows the bare problem); None
    when there is none or ``template_share`` is None."""
    found = (
        detect_template([f["problem"] for f in fields], min_share=template_share)
        if template_share is not None
        else None
    )
    if found is None:
        return None
    for f in fields:
        bare = strip_template(f["problem"], found)
        if bare != f["problem"]:
            f["problem"] = bare
            if not f["id_explicit"]:
                f["prompt_id"] = f"{spec.name}-{hashlib.sha256(bare.encode()).hexdigest()[:16]}"
    return found


def _rows_table(cols: dict[str, list], extra_fields: list[str]) -> pa.Table:
    types = {"rid": pa.int64(), "source_row": pa.int64(), "id_explicit": pa.bool_(), "level": pa.int32()}
    return pa.table({k: pa.array(v, types.get(k, pa.string())) for k, v in cols.items()})


def _write(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd")


def ingest(
    sources: Sequence[SourceSpec],
    out_dir: Path,
    *,
    near_dup_threshold: float = 0.85,
    ngram: int = 5,
    num_perm: int = 128,
    bands: int = 32,
    seed: int = 0,
    near_dup_same_answer: bool = True,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
    template_share: float | None = TEMPLATE_SHARE,
    verifiability: Verifiability = "short_form",
    allow_empty: bool = False,
) -> dict[str, float]:
    """Read, normalise, quarantine and deduplicate ``sources`` into ``out_dir`` (see the module
    docstring for the three tables). ``near_dup_threshold``, ``ngram``, ``num_perm``, ``bands`` and
    ``seed`` tune near dedup (``data_curation.dedup``); with ``near_dup_same_answer`` only prompts
    with the same canonical answer can be near duplicates, so that siblings such as "find the sum
    of the roots" / "find the product of the roots" of one equation both stay (in MATH train, 53 of
    59 textual near duplicates at 0.85 are such siblings). Exact duplicates ignore answers.
    A problem longer than ``max_prompt_chars`` (``data.max_prompt_chars``) is quarantined.
    An instruction wrapper shared by at least ``template_share`` of a source's rows is taken out of
    them before the ids and dedup (``data_curation.templates``; None keeps every problem as it is)
    and written to ``templates.parquet`` (source, template, prefix, suffix, rows, matched).
    With ``verifiability="short_form"`` (``data.verifiability``) a reference answer the verifier
    cannot check (a proof, a multi-part answer, free text; ``data_curation.verifiability``) is
    quarantined as "unverifiable answer: <kind> (...)"; ``"off"`` keeps it.
    A pool of which no row is kept raises :class:`SourceError` naming the quarantine reasons, before
    any table is written, unless ``allow_empty`` (``data.allow_empty``).
    Returns counts: rows_in, ingested, quarantined, duplicates_exact, duplicates_near, and
    rows_in_<source> / ingested_<source> per source; templated_sources and template_stripped (rows
    that lost the wrapper) when some source had one; unverifiable and unverifiable_<kind> (spaces
    and dashes as ``_``) when some answer was."""
    params = _checked(
        sources, near_dup_threshold, ngram, num_perm, bands, seed, max_prompt_chars, verifiability
    )
    names = [s.name for s in sources]
    extra_fields = list(dict.fromkeys(f for s in sources for f in s.extra_fields))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cols, records, quarantine, per_source, templates = _collect(
        sources, extra_fields, max_prompt_chars, template_share, verifiability
    )
    prompts, duplicates, dup_ids = _dedup(cols, extra_fields, params, near_dup_same_answer)
    for rid in dup_ids:
        row = {
            "source": cols["source"][rid],
            "source_row": cols["source_row"][rid],
            "raw": _raw(records[rid]),
        }
        quarantine.append((names.index(cols["source"][rid]), {**row, "reason": "duplicate id"}))
    quarantine.sort(key=lambda q: (q[0], q[1]["source_row"]))
    quarantined = [q for _, q in quarantine]
    if prompts.num_rows == 0 and not allow_empty:
        reasons = [q["reason"] for q in quarantined] + ["duplicate"] * duplicates.num_rows
        raise SourceError(empty_pool_error(sum(per_source.values()), reasons))
    _write_tables(out_dir, prompts, quarantined, duplicates, templates)
    return _counts(prompts, duplicates, quarantined, templates, per_source, names)


def _checked(
    sources: Sequence[SourceSpec],
    near_dup_threshold: float,
    ngram: int,
    num_perm: int,
    bands: int,
    seed: int,
    max_prompt_chars: int,
    verifiability: Verifiability,
) -> NearDupParams:
    """The near-dedup parameters, once every argument of ``ingest`` is checked."""
    params = NearDupParams(
        threshold=near_dup_threshold, ngram=ngram, num_perm=num_perm, bands=bands, seed=seed
    )
    params.validate()
    if max_prompt_chars <= 0:
        raise ValueError(f"max_prompt_chars must be > 0, got {max_prompt_chars}")
    if verifiability not in VERIFIABILITY:
        raise ValueError(f"verifiability={verifiability!r} is not one of {', '.join(VERIFIABILITY)}")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"source names must be unique, got {names}")
    return params


def _dedup(
    cols: dict[str, list], extra_fields: list[str], params: NearDupParams, near_dup_same_answer: bool
) -> tuple[pa.Table, pa.Table, list[int]]:
    """Deduplicate the accepted rows in DuckDB: (prompts kept, duplicates found, rows whose id an
    earlier row holds). Exact duplicates first (ignoring answers), then near duplicates among the
    unique rows (of the same answer with ``near_dup_same_answer``)."""
    from data_curation.db import memory_db

    con = memory_db()
    try:
        con.register("_rows", _rows_table(cols, extra_fields))
        dup_ids = _duplicate_ids(con)
        con.execute(
            "CREATE TEMP VIEW _live AS SELECT rid, problem AS text FROM _rows "
            "WHERE rid NOT IN (SELECT rid FROM _dup_ids)"
        )
        con.register("_exact", exact_duplicates(con, "_live"))
        con.execute(
            "CREATE TEMP VIEW _unique AS SELECT l.rid, l.text, r.answer FROM _live l "
            "JOIN _exact e ON e.rid = l.rid AND e.canonical_rid = l.rid JOIN _rows r ON r.rid = l.rid"
        )
        con.register(
            "_near", near_duplicates(con, "_unique", params, match="answer" if near_dup_same_answer else None)
        )
        return _select_prompts(con, extra_fields), _select_duplicates(con), dup_ids
    finally:
        con.close()


def _write_tables(
    out_dir: Path, prompts: pa.Table, quarantined: list[dict], duplicates: pa.Table, templates: dict
) -> None:
    """The four tables of the module docstring, in ``out_dir``."""
    _write(prompts, out_dir / "prompts.parquet")
    _write(pa.Table.from_pylist(quarantined, schema=QUARANTINE_SCHEMA), out_dir / "quarantine.parquet")
    _write(duplicates, out_dir / "duplicates.parquet")
    rows = [
        {
            "source": n,
            "template": t.text,
            "prefix": t.prefix,
            "suffix": t.suffix,
            "rows": t.rows,
            "matched": t.matched,
        }
        for n, t in templates.items()
    ]
    _write(pa.Table.from_pylist(rows, schema=TEMPLATES_SCHEMA), out_dir / "templates.parquet")


def _counts(
    prompts: pa.Table,
    duplicates: pa.Table,
    quarantined: list[dict],
    templates: dict,
    per_source: dict[str, float],
    names: list[str],
) -> dict[str, float]:
    """``ingest``'s counts (its docstring), checked to add up."""
    kinds = duplicates.column("kind").to_pylist()
    counts = {
        "rows_in": sum(per_source.values()),
        "ingested": float(prompts.num_rows),
        "quarantined": float(len(quarantined)),
        "duplicates_exact": float(kinds.count("exact")),
        "duplicates_near": float(kinds.count("near")),
    }
    if templates:  # only then, so that the counts of a pool without wrappers stay as they were
        counts["templated_sources"] = float(len(templates))
        counts["template_stripped"] = float(sum(t.matched for t in templates.values()))
    counts.update(unverifiable_counts(q["reason"] for q in quarantined))
    assert counts["rows_in"] == (
        counts["ingested"] + counts["quarantined"] + counts["duplicates_exact"] + counts["duplicates_near"]
    ), counts
    ingested_by_source = prompts.group_by("source").aggregate([("prompt_id", "count")]).to_pydict()
    by_source = dict(zip(ingested_by_source["source"], ingested_by_source["prompt_id_count"]))
    for name in names:
        counts[f"rows_in_{name}"] = per_source[f"rows_in_{name}"]
        counts[f"ingested_{name}"] = float(by_source.get(name, 0))
    return counts


def unverifiable_counts(reasons: Iterable[str]) -> dict[str, float]:
    """``unverifiable`` and ``unverifiable_<kind>`` over quarantine reasons; {} when none is."""
    kinds = [r[len(UNVERIFIABLE) + 2 :].split(" (")[0] for r in reasons if r.startswith(UNVERIFIABLE + ":")]
    if not kinds:
        return {}
    out = {"unverifiable": float(len(kinds))}
    for kind in UNVERIFIABLE_KINDS:
        if kind in kinds:
            out["unverifiable_" + re.sub(r"[ -]", "_", kind)] = float(kinds.count(kind))
    return out


def _duplicate_ids(con) -> list[int]:
    """Create ``_dup_ids``: rows whose prompt_id an earlier row already holds, when either id was given
    by the source (two derived ids collide only for equal problems: exact dedup records those)."""
    con.execute("""
        CREATE TEMP TABLE _dup_ids AS SELECT rid FROM (
            SELECT rid, id_explicit, row_number() OVER w AS rn,
                first_value(id_explicit) OVER w AS first_explicit
            FROM _rows WINDOW w AS (PARTITION BY prompt_id ORDER BY rid)
        ) WHERE rn > 1 AND (id_explicit OR first_explicit)
    """)
    return [r[0] for r in con.execute("SELECT rid FROM _dup_ids ORDER BY rid").fetchall()]


def _select_prompts(con, extra_fields: list[str]) -> pa.Table:
    extras = "".join(f', r."{f}"' for f in extra_fields)
    table = con.sql(f"""
        SELECT r.prompt_id, r.source, r.source_row, r.problem, r.answer, r.level, r.subject,
            e.text_hash{extras}
        FROM _rows r JOIN _exact e ON e.rid = r.rid
        WHERE e.canonical_rid = r.rid AND r.rid NOT IN (SELECT rid FROM _near)
        ORDER BY r.rid
    """).to_arrow_table()
    return table.cast(prompts_schema(extra_fields))


def _select_duplicates(con) -> pa.Table:
    table = con.sql("""
        SELECT r.source, r.source_row, r.prompt_id, c.prompt_id AS canonical_id, kind, similarity FROM (
            SELECT rid, canonical_rid, 'exact' AS kind, 1.0::DOUBLE AS similarity FROM _exact
            WHERE rid <> canonical_rid
            UNION ALL
            SELECT rid, canonical_rid, 'near' AS kind, similarity FROM _near
        ) d JOIN _rows r ON r.rid = d.rid JOIN _rows c ON c.rid = d.canonical_rid
        ORDER BY d.rid
    """).to_arrow_table()
    return table.cast(DUPLICATES_SCHEMA)
