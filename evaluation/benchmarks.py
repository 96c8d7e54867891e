"""Benchmark registry over the vendored JSON-lines files in ``evaluation/data/``.

Each benchmark is one ``BenchmarkSpec`` in the explicit ``BENCHMARKS`` dict: which file, which
fields hold the problem, the gold answer (or how to extract it) and the id, and the default
prompt template. ``load_benchmark`` turns a file into ``BenchmarkItem`` records whose ``answer``
is already normalised with the verifier's ``normalize_answer``. The pipeline's own held-out sets
become ``BenchmarkItem`` records through ``items_from_records``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewards.verifier import extract_answer, normalize_answer

__all__ = [
    "BENCHMARKS",
    "DATA_DIR",
    "DEFAULT_TEMPLATE",
    "BenchmarkItem",
    "BenchmarkSpec",
    "FileBenchmark",
    "benchmark_path",
    "build_prompt",
    "get_spec",
    "items_from_records",
    "load_benchmark",
    "load_with_datasets",
]

DATA_DIR = Path(__file__).resolve().parent / "data"

DEFAULT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class BenchmarkItem:
    """One evaluation problem. ``answer`` is normalised (``normalize_answer``); ``problem_id``
    is unique within ``benchmark``."""

    benchmark: str
    problem_id: str
    problem: str
    answer: str
    level: str | None = None
    subject: str | None = None


def _gsm8k_gold(solution: Any) -> str | None:
    """GSM8K's ``answer`` field is a worked solution ending in ``#### <gold>``."""
    return extract_answer(str(solution))


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to read one vendored benchmark file.

    ``answer_extract`` (optional) maps the raw ``answer_field`` value to the gold answer;
    ``id_field`` None means the 0-based row index is the id.
    """

    name: str
    file: str
    problem_field: str
    answer_field: str
    id_field: str | None
    template: str = DEFAULT_TEMPLATE
    answer_extract: Callable[[Any], str | None] | None = None
    level_field: str | None = None
    subject_field: str | None = None


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "gsm8k": BenchmarkSpec(
        name="gsm8k",
        file="gsm8k_test.jsonl",
        problem_field="question",
        answer_field="answer",
        id_field=None,
        answer_extract=_gsm8k_gold,
    ),
    "math500": BenchmarkSpec(
        name="math500",
        file="math500_test.jsonl",
        problem_field="problem",
        answer_field="answer",
        id_field="unique_id",
        level_field="level",
        subject_field="subject",
    ),
    "aime24": BenchmarkSpec(
        name="aime24",
        file="aime24_test.jsonl",
        problem_field="problem",
        answer_field="answer",
        id_field="id",
    ),
    "aime25": BenchmarkSpec(
        name="aime25",
        file="aime25_test.jsonl",
        problem_field="problem",
        answer_field="answer",
        id_field="id",
    ),
    "amc23": BenchmarkSpec(
        name="amc23",
        file="amc23_test.jsonl",
        problem_field="problem",
        answer_field="answer",
        id_field="id",
    ),
}


@dataclass(frozen=True)
class FileBenchmark:
    """A benchmark from an ``eval.benchmarks`` file spec, read (``data_curation.benchmark_files``):
    its items in file order, the sha256 of its file (or folder), the components that score it and
    its prompt template."""

    name: str
    items: tuple[BenchmarkItem, ...]
    sha256: str
    score_with: tuple[str, ...] = ("math_verify",)
    template: str = DEFAULT_TEMPLATE


def get_spec(name: str) -> BenchmarkSpec:
    try:
        return BENCHMARKS[name]
    except KeyError:
        raise ValueError(
            f"unknown benchmark {name!r}; valid names: {', '.join(sorted(BENCHMARKS))}"
        ) from None


CODE_FILES = {"humaneval": "HumanEval.jsonl.gz"}
"""Code benchmark name -> its vendored file (read by ``evaluation.code_benchmarks``)."""


def benchmark_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The vendored file of benchmark ``name`` (under ``data_dir`` if given)."""
    if name in CODE_FILES:
        return Path(data_dir or DATA_DIR) / CODE_FILES[name]
    spec = get_spec(name)
    return Path(data_dir) / spec.file if data_dir is not None else DATA_DIR / spec.file


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _item(spec: BenchmarkSpec, row: Mapping[str, Any], index: int, where: str) -> BenchmarkItem:
    missing = [f for f in (spec.problem_field, spec.answer_field, spec.id_field) if f and f not in row]
    if missing:
        raise ValueError(f"{where}: row {index} lacks field(s) {missing} needed by benchmark {spec.name!r}")
    raw_answer = row[spec.answer_field]
    gold = spec.answer_extract(raw_answer) if spec.answer_extract else raw_answer
    answer = normalize_answer(gold)
    if not answer:
        raise ValueError(f"{where}: row {index} of benchmark {spec.name!r} has no gold answer")
    return BenchmarkItem(
        benchmark=spec.name,
        problem_id=str(row[spec.id_field]) if spec.id_field else str(index),
        problem=str(row[spec.problem_field]),
        answer=answer,
        level=_optional_str(row.get(spec.level_field)) if spec.level_field else None,
        subject=_optional_str(row.get(spec.subject_field)) if spec.subject_field else None,
    )


def _items(spec: BenchmarkSpec, rows: Iterable[Mapping[str, Any]], where: str) -> list[BenchmarkItem]:
    items = [_item(spec, row, i, where) for i, row in enumerate(rows)]
    seen: set[str] = set()
    for item in items:
        if item.problem_id in seen:
            raise ValueError(f"{where}: duplicate problem id {item.problem_id!r} in {spec.name!r}")
        seen.add(item.problem_id)
    return items


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[BenchmarkItem]:
    """Read benchmark ``name`` from its JSON-lines file, in file order."""
    spec = get_spec(name)
    path = benchmark_path(name, data_dir)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {path} not found (expected the vendored {spec.file})")
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return _items(spec, rows, str(path))


def load_with_datasets(
    name: str, data_dir: str | Path | None = None, cache_dir: str | None = None
) -> list[BenchmarkItem]:
    """Same as ``load_benchmark``, read through ``datasets.load_dataset("json", ...)``."""
    import datasets

    spec = get_spec(name)
    path = benchmark_path(name, data_dir)
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
    return _items(spec, ds, str(path))


def items_from_records(
    benchmark: str, records: Iterable[Mapping[str, Any] | Any], *, id_key: str = "problem_id"
) -> list[BenchmarkItem]:
    """``BenchmarkItem`` records for a set that is not vendored (e.g. the synthetic held-out set).

    Each record is a mapping or an object with ``problem``, ``answer``, the id under ``id_key``
    and optionally ``level`` and ``subject``.
    """

    def get(record: Any, key: str, required: bool) -> Any:
        if isinstance(record, Mapping):
            if key in record:
                return record[key]
        elif hasattr(record, key):
            return getattr(record, key)
        if required:
            raise ValueError(f"record for benchmark {benchmark!r} lacks {key!r}: {record!r}"[:300])
        return None

    items = []
    for record in records:
        answer = normalize_answer(get(record, "answer", True))
        if not answer:
            raise ValueError(f"record {get(record, id_key, True)!r} of {benchmark!r} has an empty answer")
        items.append(
            BenchmarkItem(
                benchmark=benchmark,
                problem_id=str(get(record, id_key, True)),
                problem=str(get(record, "problem", True)),
                answer=answer,
                level=_optional_str(get(record, "level", False)),
                subject=_optional_str(get(record, "subject", False)),
            )
        )
    return items


def build_prompt(item: BenchmarkItem, template: str | None = None) -> str:
    """The prompt for ``item``: ``template`` (or its benchmark's default) with ``{problem}``
    replaced. Only that placeholder is substituted, so templates need no brace escaping."""
    if template is None:
        if item.benchmark not in BENCHMARKS:
            raise ValueError(
                f"benchmark {item.benchmark!r} has no registered template; pass template=..., "
                "a string containing '{problem}'"
            )
        template = BENCHMARKS[item.benchmark].template
    if "{problem}" not in template:
        raise ValueError(f"template must contain '{{problem}}', got {template!r}")
    return template.replace("{problem}", item.problem)
