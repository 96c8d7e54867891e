"""Benchmarks from ``eval.benchmarks`` file specs, read with the prompt-pool readers of
``data_curation.ingest`` (jsonl, json, parquet, verl, Hugging Face datasets; dotted field paths)."""

from __future__ import annotations

from collections.abc import Iterable

from conf.schema import BenchmarkFileConfig
from core.errors import StageError
from data_curation.ingest import SourceSpec, _lookup, read_source
from data_curation.sources import resolve_source_path, source_hashes
from evaluation.benchmarks import DEFAULT_TEMPLATE, BenchmarkItem, FileBenchmark
from rewards.verifier import normalize_answer

__all__ = ["BenchmarkFileError", "load_file_benchmark", "load_file_benchmarks"]


class BenchmarkFileError(StageError, ValueError):
    """A benchmark file that cannot be read, or a row without its problem, answer or id; the
    message names the benchmark, the row and the field."""


def _text(value) -> str | None:
    return None if value is None else str(value)


def _read_rows(spec: BenchmarkFileConfig, where: str) -> tuple[SourceSpec, list[dict]]:
    """The source ``spec`` names and its rows (``record``, ``source_row``), every one a JSON object."""
    local = resolve_source_path(spec.path)
    if local is None and spec.format != "hf":
        raise BenchmarkFileError(f"{where}: no such file or folder (only format=hf may name a hub dataset)")
    source = SourceSpec(
        name=spec.name,
        path=str(local) if local is not None else spec.path,
        format=spec.format,
        problem_field=spec.problem_field,
        answer_field=spec.answer_field,
        id_field=spec.id_field,
        split=spec.split,
    )
    try:
        rows, bad = read_source(source)
    except (OSError, ValueError) as err:
        raise BenchmarkFileError(f"{where}: {err}") from None
    if bad:
        raise BenchmarkFileError(
            f"{where}: row {bad[0]['source_row']} is not a JSON object ({bad[0]['reason']})"
        )
    return source, rows


def _required_fields(spec: BenchmarkFileConfig, record: dict, index: int, where: str) -> dict:
    """The values of the problem, answer and (when named) id fields of row ``index``, by spec key."""
    fields = {}
    for key in ("problem_field", "answer_field", "id_field"):
        name = getattr(spec, key)
        if name is None:
            continue
        found, value = _lookup(record, name)
        if not found or value is None:
            raise BenchmarkFileError(
                f"{where}: row {index} has no field {name!r} ({key}); its fields are {sorted(record)[:12]}"
            )
        fields[key] = value
    return fields


def _item(spec: BenchmarkFileConfig, record: dict, index: int, where: str) -> BenchmarkItem:
    """Row ``index`` as a benchmark item, its answer normalised; its id the row number when
    ``spec`` names no id field."""
    fields = _required_fields(spec, record, index, where)
    answer = normalize_answer(fields["answer_field"])
    if not answer:
        raise BenchmarkFileError(f"{where}: row {index} has an empty {spec.answer_field!r}")
    return BenchmarkItem(
        benchmark=spec.name,
        problem_id=str(fields["id_field"]) if spec.id_field else str(index),
        problem=str(fields["problem_field"]),
        answer=answer,
        level=_text(_lookup(record, spec.level_field)[1]) if spec.level_field else None,
        subject=_text(_lookup(record, spec.subject_field)[1]) if spec.subject_field else None,
    )


def load_file_benchmark(spec: BenchmarkFileConfig) -> FileBenchmark:
    """Every row of ``spec``'s file as a :class:`BenchmarkItem`; raises :class:`BenchmarkFileError`
    at the first row that lacks the problem, the answer (or has an empty one) or the id, and on a
    duplicate id or an unreadable file."""
    where = f"eval benchmark {spec.name!r} ({spec.path})"
    source, rows = _read_rows(spec, where)
    items, seen = [], set()
    for row in rows:
        item = _item(spec, row["record"], row["source_row"], where)
        if item.problem_id in seen:
            raise BenchmarkFileError(
                f"{where}: duplicate problem id {item.problem_id!r} (row {row['source_row']})"
            )
        seen.add(item.problem_id)
        items.append(item)
    if not items:
        raise BenchmarkFileError(f"{where}: no rows")
    return FileBenchmark(
        name=spec.name,
        items=tuple(items),
        sha256=source_hashes([source])[f"source:{spec.name}"],
        score_with=tuple(spec.score_with),
        template=spec.template or DEFAULT_TEMPLATE,
    )


def load_file_benchmarks(specs: Iterable[BenchmarkFileConfig]) -> dict[str, FileBenchmark]:
    return {s.name: load_file_benchmark(s) for s in specs}
