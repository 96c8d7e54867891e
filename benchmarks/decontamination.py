"""Decontamination recall on rewritten benchmark copies, false flags on a clean pool, and speed.

Builds its own test set from the vendored benchmarks (MATH-500, GSM8K, AIME 2024/2025, AMC 2023):
for each kind of rewrite below, up to ``--per-kind`` items (seeded; every applicable AIME/AMC item,
the rest split between MATH-500 and GSM8K; an item is used by one kind only) are rewritten and
planted as a second source next to the vendored MATH train pool (7,474 rows), then ingested and
decontaminated against all five benchmarks with the configured defaults. Kinds:

- ``symbols_renamed``: every one-letter symbol inside math renamed (consistently), ``\\frac`` restyled
  as ``\\dfrac``, one symbol set in ``\\mathcal``/``\\mathit``;
- ``clauses_reordered``: the question sentence moved to the front (or a leading "If ..., " clause to
  the end) and its verb reworded ("Find" -> "Determine", "What is" -> "Compute", ...);
- ``figures_dropped``: the ``[asy]`` figure code removed (items that have one);
- ``numbers_in_words``: numbers 0-99 in the prose (and ``$n$`` alone) written as words;
- ``wrappers_added``: one of four public RL-pool instruction wrappers around the problem;
- ``combined`` (reported, not in the target): all that apply at once.

A planted row counts as caught when it is flagged against the very item it copies (by either
rule). False flags: the same decontamination of MATH train alone (MATH-500 shares no problem with
it), every flag listed with both texts so a sample can be judged by hand. Timing: the
decontamination of MATH train against all five benchmarks (both rules), best of ``--repeats``.

    .venv/bin/python benchmarks/decontamination.py [--per-kind 80] [--seed 0] [--out DIR]

Writes ``benchmarks/results/decontamination/decontamination_<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow.parquet as pq

from conf.schema import DecontamConfig
from data_curation.decontaminate import ParaphraseParams, decontaminate
from data_curation.ingest import SourceSpec, ingest
from evaluation.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parent.parent
MATH_TRAIN = ROOT / "data_curation" / "data" / "math_train.json"
BENCHES = ("math500", "gsm8k", "aime24", "aime25", "amc23")
KINDS = ("symbols_renamed", "clauses_reordered", "figures_dropped", "numbers_in_words", "wrappers_added")
TARGET = 0.95

WRAPPERS = [  # (prefix, suffix), as public RL pools put them around problems
    (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n",
        '\n\nRemember to put your answer on its own line after "Answer:".',
    ),
    ("", " Let's think step by step and output the final answer within \\boxed{}."),
    ("Question: ", "\nPlease reason step by step, and put your final answer within \\boxed{}."),
    (
        "You are a helpful math assistant. Solve the problem below and give only the final answer."
        "\n\nProblem: ",
        "",
    ),
]
_MATH_RE = re.compile(r"(\$\$.*?\$\$|\$.*?\$|\\\[.*?\\\]|\\\(.*?\\\))", re.S)
_VAR_RE = re.compile(r"(?<![A-Za-z\\])([A-Za-z])(?![A-Za-z])")
_ASY_RE = re.compile(r"\s*\[asy\].*?\[/asy\]\s*", re.S)
_SENT_RE = re.compile(r"(?<=[.?!])\s+(?=[A-Z$\\])")
_NUM_RE = re.compile(r"(?<![\d.,$\\^_{])\b(\d{1,2})\b(?![\d.,]\d)")
_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split()
)
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
REWORD = [
    ("What is the value of", "Compute"),
    ("What is", "Compute"),
    ("Find", "Determine"),
    ("Compute", "Calculate"),
    ("How many", "Determine how many"),
    ("Determine", "Find"),
    ("Evaluate", "Compute"),
    ("Calculate", "Compute"),
    ("Simplify", "Write in simplest form"),
    ("Express", "Write"),
]


def _words(n: int) -> str:
    if n < 20:
        return _ONES[n]
    return _TENS[n // 10] + ("" if n % 10 == 0 else "-" + _ONES[n % 10])


def _on_math(text: str, fn) -> str:
    """``fn`` applied to each math segment of ``text``, prose untouched."""
    return "".join(fn(p) if i % 2 else p for i, p in enumerate(_MATH_RE.split(text)))


def _on_prose(text: str, fn) -> str:
    return "".join(p if i % 2 else fn(p) for i, p in enumerate(_MATH_RE.split(text)))


def symbols_renamed(text: str, rng: random.Random) -> str | None:
    used = set()
    _on_math(text, lambda m: used.update(_VAR_RE.findall(m)) or m)
    if not used:
        return None
    free = [c for c in "pqrstuvwkmnzyxabcdfgh" if c not in {u.lower() for u in used}]
    rng.shuffle(free)
    mapping = {
        u: (free[i % len(free)].upper() if u.isupper() else free[i % len(free)])
        for i, u in enumerate(sorted(used))
    }
    styled = sorted(used)[0]
    style = "\\mathcal" if styled.isupper() else "\\mathit"

    def rename(m: str) -> str:
        m = _VAR_RE.sub(
            lambda v: f"{style}{{{mapping[v.group(1)]}}}" if v.group(1) == styled else mapping[v.group(1)], m
        )
        return m.replace("\\frac", "\\dfrac")

    out = _on_math(text, rename)
    return out if out != text else None


def _reword(sentence: str) -> str:
    for old, new in REWORD:
        if sentence.startswith(old):
            return new + sentence[len(old) :]
    return sentence


def clauses_reordered(text: str, rng: random.Random) -> str | None:
    body = _ASY_RE.sub(" ", text).strip() if "[asy]" in text else text
    sentences = [s for s in _SENT_RE.split(body) if s]
    if len(sentences) >= 2:
        out = " ".join([_reword(sentences[-1])] + sentences[:-1])
    else:
        m = re.match(r"(If|Given that|Suppose) ([^?]{10,}?), (\w)(.*)$", body, re.S)
        if not m:
            return None
        out = f"{m.group(3).upper()}{m.group(4).rstrip('?.')}, {m.group(1).lower()} {m.group(2)}?"
    if "[asy]" in text:  # the figure stays, after the text
        out += "\n" + "\n".join(re.findall(r"\[asy\].*?\[/asy\]", text, re.S))
    return out if out != text else None


def figures_dropped(text: str, rng: random.Random) -> str | None:
    if "[asy]" not in text:
        return None
    return _ASY_RE.sub(" ", text).strip()


def numbers_in_words(text: str, rng: random.Random) -> str | None:
    out = re.sub(r"\$(\d{1,2})\$", lambda m: _words(int(m.group(1))), text)
    out = _on_prose(out, lambda p: _NUM_RE.sub(lambda m: _words(int(m.group(1))), p))
    return out if out != text else None


def wrappers_added(text: str, rng: random.Random) -> str | None:
    prefix, suffix = WRAPPERS[rng.randrange(len(WRAPPERS))]
    return prefix + text + suffix


REWRITES = {k: globals()[k] for k in KINDS}


def combined(text: str, rng: random.Random) -> str | None:
    out = text
    for kind in (
        "figures_dropped",
        "symbols_renamed",
        "numbers_in_words",
        "clauses_reordered",
        "wrappers_added",
    ):
        out = REWRITES[kind](out, rng) or out
    return out if out != text else None


def plant_set(per_kind: int, seed: int) -> list[dict]:
    """Rewritten copies: (kind, benchmark, problem_id, problem, answer), disjoint items per kind."""
    rng = random.Random(seed)
    items = {b: load_benchmark(b) for b in BENCHES}
    taken: set[tuple[str, str]] = set()
    plants = []
    for kind, fn in [*REWRITES.items(), ("combined", combined)]:
        chosen: list[tuple] = []
        small = [it for b in ("aime24", "aime25", "amc23") for it in items[b]]
        big = items["math500"] + items["gsm8k"]
        rng.shuffle(small)
        rng.shuffle(big)
        quota_small = per_kind // 4
        for pool, quota in ((small, quota_small), (big, per_kind)):
            for it in pool:
                if len(chosen) >= quota or (pool is big and len(chosen) >= per_kind):
                    break
                if (it.benchmark, it.problem_id) in taken:
                    continue
                text = fn(it.problem, rng)
                if text is None or text == it.problem:
                    continue
                taken.add((it.benchmark, it.problem_id))
                chosen.append((it, text))
        for it, text in chosen:
            plants.append(
                {
                    "plant_id": f"plant-{kind}-{it.benchmark}-{it.problem_id}",
                    "kind": kind,
                    "benchmark": it.benchmark,
                    "benchmark_problem_id": it.problem_id,
                    "problem": text,
                    "answer": it.answer,
                    "original": it.problem,
                }
            )
    return plants


def _own_item_scores(
    plants: list[dict], items: list, para: ParaphraseParams
) -> dict[str, tuple[float, int, int]]:
    """plant_id -> (paraphrase score against the item it copies, that item's shingle count and content
    words); absent when LSH does not even make them candidates."""
    import pyarrow as pa

    from data_curation.db import memory_db
    from data_curation.decontaminate import _items_table, paraphrase_hits

    table = pa.table(
        {
            "rid": pa.array(range(len(plants)), pa.int64()),
            "prompt_id": [p["plant_id"] for p in plants],
            "source": ["plants"] * len(plants),
            "text": [p["problem"] for p in plants],
            "answer": [p["answer"] for p in plants],
        }
    )
    con = memory_db()
    try:
        hits = paraphrase_hits(
            con,
            table,
            _items_table(items),
            ParaphraseParams(
                high=1e-9,
                moderate=1e-9,
                ngram=para.ngram,
                num_perm=para.num_perm,
                bands=para.bands,
                seed=para.seed,
                min_shingles=0,
                min_words=0,
            ),
        )
        sizes = {
            k: (n, w)
            for k, n, w in con.execute(
                "SELECT i.benchmark || '/' || i.problem_id, s.n, i.words FROM _para_items i "
                "JOIN _psh_size s ON s.rid = i.rid"
            ).fetchall()
        }
    finally:
        con.close()
    own = {p["plant_id"]: (p["benchmark"], p["benchmark_problem_id"]) for p in plants}
    out: dict[str, tuple[float, int, int]] = {}
    for h in hits.to_pylist():
        if own[h["prompt_id"]] == (h["benchmark"], h["benchmark_problem_id"]):
            out[h["prompt_id"]] = (
                h["score"],
                *sizes.get(f"{h['benchmark']}/{h['benchmark_problem_id']}", (0, 0)),
            )
    return out


def run(per_kind: int, seed: int, repeats: int, work: Path) -> dict:
    """The measurements, with every intermediate table under ``work``."""
    cfg = DecontamConfig()
    para = ParaphraseParams(
        high=cfg.paraphrase_high,
        moderate=cfg.paraphrase_moderate,
        ngram=cfg.paraphrase_ngram,
        num_perm=cfg.paraphrase_num_perm,
        bands=cfg.paraphrase_bands,
        seed=seed,
    )
    items = [it for b in BENCHES for it in load_benchmark(b)]
    by_item = {(it.benchmark, it.problem_id): it for it in items}
    math = SourceSpec("math_train", str(MATH_TRAIN), level_field="difficulty", subject_field="type")

    # clean pool: MATH train alone (false flags, timing)
    ingest([math], work / "clean_ingest")
    timings = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        clean_counts = decontaminate(
            work / "clean_ingest" / "prompts.parquet",
            items,
            work / "clean_out",
            ngram=cfg.ngram,
            min_coverage=cfg.min_coverage,
            paraphrase=para,
        )
        timings.append(time.perf_counter() - t0)
    ngram_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        decontaminate(
            work / "clean_ingest" / "prompts.parquet",
            items,
            work / "clean_ngram_only",
            ngram=cfg.ngram,
            min_coverage=cfg.min_coverage,
            paraphrase=None,
        )
        ngram_times.append(time.perf_counter() - t0)
    ngram_only_s = min(ngram_times)
    pool = pq.read_table(work / "clean_ingest" / "prompts.parquet").to_pylist()
    text_of = {r["prompt_id"]: (r["problem"], r["answer"]) for r in pool}
    flags = pq.read_table(work / "clean_out" / "contamination.parquet").to_pylist()
    listed = []
    for f in flags:
        it = by_item[(f["benchmark"], f["benchmark_problem_id"])]
        listed.append(
            {
                "prompt_id": f["prompt_id"],
                "rule": f["rule"],
                "score": round(f["score"], 4),
                "benchmark": f["benchmark"],
                "benchmark_problem_id": f["benchmark_problem_id"],
                "prompt": text_of[f["prompt_id"]][0][:400],
                "prompt_answer": text_of[f["prompt_id"]][1],
                "item": it.problem[:400],
                "item_answer": it.answer,
            }
        )
    flagged_prompts = {f["prompt_id"] for f in flags}
    para_prompts = {f["prompt_id"] for f in flags if f["rule"] != "ngram"}

    # planted pool: MATH train + rewritten copies
    plants = plant_set(per_kind, seed)
    plant_file = work / "plants.jsonl"
    plant_file.write_text(
        "".join(
            json.dumps({"id": p["plant_id"], "problem": p["problem"], "answer": p["answer"]}) + "\n"
            for p in plants
        ),
        encoding="utf-8",
    )
    counts = ingest([math, SourceSpec("plants", str(plant_file), id_field="id")], work / "plant_ingest")
    decontaminate(
        work / "plant_ingest" / "prompts.parquet",
        items,
        work / "plant_out",
        ngram=cfg.ngram,
        min_coverage=cfg.min_coverage,
        paraphrase=para,
    )
    hits = pq.read_table(work / "plant_out" / "contamination.parquet").to_pylist()
    caught: dict[str, set] = {}
    for h in hits:
        caught.setdefault(h["prompt_id"], set()).add((h["benchmark"], h["benchmark_problem_id"], h["rule"]))
    ingested = {
        r["prompt_id"]
        for r in pq.read_table(work / "plant_ingest" / "prompts.parquet", columns=["prompt_id"]).to_pylist()
    }
    per_kind_out: dict[str, dict] = {}
    missed = []
    for p in plants:
        k = per_kind_out.setdefault(
            p["kind"],
            {"planted": 0, "ingested": 0, "caught": 0, "by_ngram": 0, "by_paraphrase": 0, "by_benchmark": {}},
        )
        k["planted"] += 1
        if p["plant_id"] not in ingested:
            continue
        k["ingested"] += 1
        rules = {
            r
            for b, pid, r in caught.get(p["plant_id"], ())
            if (b, pid) == (p["benchmark"], p["benchmark_problem_id"])
        }
        kb = k["by_benchmark"].setdefault(p["benchmark"], {"planted": 0, "caught": 0})
        kb["planted"] += 1
        if rules:
            k["caught"] += 1
            kb["caught"] += 1
            k["by_ngram" if "ngram" in rules else "by_paraphrase"] += 1
        else:
            missed.append(
                {
                    "kind": p["kind"],
                    "benchmark": p["benchmark"],
                    "problem_id": p["benchmark_problem_id"],
                    "rewritten": p["problem"][:500],
                    "original": p["original"][:500],
                }
            )
    # each rule alone: every plant's paraphrase score against its own item (all candidates kept)
    scores = _own_item_scores(plants, items, para)
    for p in plants:
        k = per_kind_out[p["kind"]]
        s, n_item, words = scores.get(p["plant_id"], (0.0, 0, 0))
        gate = words >= para.min_words
        ngram_hit = any(
            r == "ngram" and (b, pid) == (p["benchmark"], p["benchmark_problem_id"])
            for b, pid, r in caught.get(p["plant_id"], ())
        )
        k.setdefault("scores", []).append(round(s, 3))
        # every plant keeps its item's answer: the rule alone flags it at the moderate score
        k["paraphrase_rule_alone"] = k.get("paraphrase_rule_alone", 0) + int(
            gate and s >= para.moderate - 1e-12
        )
        # as if the answers differed: the n-gram rule, or the high score
        k["answer_blind"] = k.get("answer_blind", 0) + int(
            ngram_hit or (gate and s >= para.high - 1e-12 and n_item >= para.min_shingles)
        )
    for k in per_kind_out.values():
        k["recall"] = k["caught"] / k["ingested"] if k["ingested"] else None
        k["min_score"] = min(k.pop("scores"))
        k["recall_paraphrase_rule_alone"] = k["paraphrase_rule_alone"] / k["planted"]
        k["recall_answer_blind"] = k["answer_blind"] / k["planted"]
    target = [per_kind_out[k] for k in KINDS]
    overall = sum(k["caught"] for k in target) / max(1, sum(k["ingested"] for k in target))
    n_pool = clean_counts["prompts_in"]
    return {
        "date": date.today().isoformat(),
        "command": f"benchmarks/decontamination.py --per-kind {per_kind} --seed {seed} --repeats {repeats}",
        "config": {"ngram": cfg.ngram, "min_coverage": cfg.min_coverage, "paraphrase": para.__dict__},
        "benchmarks": list(BENCHES),
        "benchmark_items": len(items),
        "recall": {
            "overall_5_kinds": overall,
            "target": TARGET,
            "meets_target": overall >= TARGET and all(k["recall"] >= TARGET for k in target),
            "per_kind": per_kind_out,
        },
        "plant_ingest": {k: v for k, v in counts.items() if not k.startswith("rows_in_")},
        "missed": missed,
        "clean_pool": {
            "pool": "MATH train (data_curation/data/math_train.json)",
            "prompts": n_pool,
            "flagged_prompts": len(flagged_prompts),
            "flagged_share": len(flagged_prompts) / n_pool,
            "flagged_by_ngram": len(flagged_prompts - para_prompts),
            "flagged_by_paraphrase_only": len(para_prompts - (flagged_prompts - para_prompts)),
            "paraphrase_share": len(para_prompts) / n_pool,
            "counts": clean_counts,
            "flags": listed,
        },
        "timing": {
            "pool_prompts": n_pool,
            "benchmark_items": len(items),
            "seconds_both_rules_best": min(timings),
            "seconds_all": timings,
            "seconds_ngram_only": ngram_only_s,
            "seconds_ngram_only_all": ngram_times,
            "load_average": list(__import__("os").getloadavg()),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-kind", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decontamination")
    args = ap.parse_args()
    import shutil

    work = Path(tempfile.mkdtemp(prefix="decontam-bench-"))
    try:
        res = run(args.per_kind, args.seed, args.repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decontamination_{res['date']}.json"
    path.write_text(json.dumps(res, indent=1, sort_keys=False) + "\n")
    r = res["recall"]
    print(f"recall over the five kinds {r['overall_5_kinds']:.3f} (target {TARGET})")
    for kind, k in r["per_kind"].items():
        print(
            f"  {kind:<18} {k['caught']:>3}/{k['ingested']:<3} = {k['recall']:.3f}  "
            f"(n-gram {k['by_ngram']}, paraphrase {k['by_paraphrase']}; paraphrase rule alone "
            f"{k['recall_paraphrase_rule_alone']:.3f}, answer-blind {k['recall_answer_blind']:.3f}, "
            f"lowest score {k['min_score']:.2f})"
        )
    c = res["clean_pool"]
    print(
        f"clean pool: {c['flagged_prompts']} of {c['prompts']:.0f} flagged "
        f"({100 * c['flagged_share']:.2f}%): {c['flagged_by_ngram']} by the n-gram rule, "
        f"{c['flagged_by_paraphrase_only']} by the paraphrase rule"
    )
    t = res["timing"]
    print(
        f"timing: {t['pool_prompts']:.0f} prompts x {t['benchmark_items']} items, both rules "
        f"{t['seconds_both_rules_best']:.2f} s (n-gram only {t['seconds_ngram_only']:.2f} s)"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
