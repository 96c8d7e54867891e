"""What ingest's verifiability grading quarantines on real pools, per reason, with a sample to judge.

Two pools, each ingested with the defaults (``data.verifiability=short_form``):

- ``math_train``: the vendored MATH train split (``data_curation/data/math_train.json``, 7,474 rows);
- ``verl``: a verl-format parquet built here from the vendored benchmark files with verl's own
  preprocessing recipes (``examples/data_preprocess/gsm8k.py``: the number after ``####``;
  ``math_dataset.py``: the content of the solution's last ``\\boxed{}``), for GSM8K test (1,319) and
  MATH-500 (500), plus AIME 2024 (30) with the whole forum solution as ``ground_truth``, the way a
  web-extracted pool looks where answer extraction failed.

For each pool: rows in, ingested, quarantined, and the count per quarantine reason (unverifiable
ones by kind). Then ``--sample`` quarantined rows (seeded; unverifiable ones first) with their
answer, to be judged by hand.

    .venv/bin/python benchmarks/verifiability.py [--sample 20] [--seed 0] [--out DIR]

Writes ``verifiability_<date>.json`` and ``verifiability_<date>.md`` under
``benchmarks/results/verifiability/``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402 - after the path insert
import pyarrow.parquet as pq  # noqa: E402

from data_curation.ingest import SourceSpec, ingest  # noqa: E402
from data_curation.verifiability import UNVERIFIABLE, _words  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "evaluation" / "data"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DATE = "2026-12-03"


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (BENCH / name).open() if line.strip()]


def _last_boxed_only_string(string: str) -> str | None:
    """verl's ``math_dataset.py`` extraction (``\\boxed`` or ``\\fbox``, balanced braces)."""
    idx = string.rfind("\\boxed")
    if idx < 0:
        idx = string.rfind("\\fbox")
        if idx < 0:
            return None
    depth, right = 0, None
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                right = i
                break
    return None if right is None else string[idx : right + 1]


def _remove_boxed(s: str) -> str:
    if s.startswith("\\boxed "):
        return s[len("\\boxed ") :]
    left = "\\boxed{" if s.startswith("\\boxed{") else "\\fbox{"
    return s[len(left) : -1]


def verl_pool(path: Path) -> Path:
    rows = []

    def add(source: str, i: int, problem: str, truth: str) -> None:
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": "train", "index": f"{source}-{i}"},
            }
        )

    for i, r in enumerate(_jsonl("gsm8k_test.jsonl")):
        m = re.search(r"#### (\-?[0-9\.\,]+)", r["answer"])
        add("openai/gsm8k", i, r["question"], m.group(1).replace(",", "") if m else "")
    for i, r in enumerate(_jsonl("math500_test.jsonl")):
        boxed = _last_boxed_only_string(r["solution"])
        add("math500", i, r["problem"], _remove_boxed(boxed) if boxed else "")
    for i, r in enumerate(_jsonl("aime24_test.jsonl")):
        add("aime24_forum", i, r["problem"], r["solution"])
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _borderline(out: Path, n: int) -> list[str]:
    """The ``n`` kept answers with the most words: where a missed free-text answer would be."""
    answers = pq.read_table(out / "prompts.parquet", columns=["answer"]).column("answer").to_pylist()
    return sorted(set(answers), key=lambda a: (-len(_words(a)), a))[:n]


def measure(spec: SourceSpec, work: Path) -> tuple[dict, list[dict]]:
    out = work / spec.name
    counts = ingest([spec], out)
    quarantine = pq.read_table(out / "quarantine.parquet").to_pylist()
    reasons = collections.Counter(q["reason"].split(" (")[0] for q in quarantine)
    return {
        "rows_in": int(counts["rows_in"]),
        "ingested": int(counts["ingested"]),
        "quarantined": int(counts["quarantined"]),
        "duplicates": int(counts["duplicates_exact"] + counts["duplicates_near"]),
        "by_reason": dict(reasons.most_common()),
        "ingest_counts": {k: v for k, v in counts.items() if k.startswith("unverifiable")},
        "kept_most_words": _borderline(out, 10),
    }, quarantine


def _records(spec: SourceSpec) -> list[dict]:
    if spec.format == "verl":
        return pq.read_table(spec.path).to_pylist()
    return json.loads(Path(spec.path).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verifiability")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="verifiability-") as tmp:
        work = Path(tmp)
        specs = [
            SourceSpec(
                name="math_train", path=str(ROOT / "data_curation/data/math_train.json"), format="json"
            ),
            SourceSpec(name="verl", path=str(verl_pool(work / "verl_pool.parquet")), format="verl"),
        ]
        pools, quarantined, records = {}, [], {}
        for spec in specs:
            pools[spec.name], rows = measure(spec, work)
            quarantined += [(spec, q) for q in rows]
            records[spec.name] = _records(spec)
    rng = random.Random(args.seed)
    first = [q for q in quarantined if q[1]["reason"].startswith(UNVERIFIABLE)]
    rest = [q for q in quarantined if not q[1]["reason"].startswith(UNVERIFIABLE)]
    sample = rng.sample(first, min(args.sample, len(first)))
    sample += rng.sample(rest, min(args.sample - len(sample), len(rest)))
    sample.sort(key=lambda q: (q[0].name, q[1]["source_row"]))
    result = {
        "date": DATE,
        "command": "benchmarks/verifiability.py " + " ".join(sys.argv[1:]),
        "pools": pools,
        "sample": [
            {
                "pool": spec.name,
                "source_row": q["source_row"],
                "source": records[spec.name][q["source_row"]].get("data_source"),
                "reason": q["reason"],
                "answer": str(
                    records[spec.name][q["source_row"]]["reward_model"]["ground_truth"]
                    if spec.format == "verl"
                    else records[spec.name][q["source_row"]].get(spec.answer_field)
                )[:300],
            }
            for spec, q in sample
        ],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"verifiability_{DATE}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(json.dumps({k: v for k, v in result.items() if k != "sample"}, indent=1))
    for s in result["sample"]:
        print(f"{s['pool']}:{s['source_row']} [{s['source']}] {s['reason']}: {s['answer'][:100]!r}")


if __name__ == "__main__":
    main()
