"""The judge's rounds: the program computes in one sandbox run (``run_calls``), the tests that are not
plain pairs are evaluated in another, fresh one (``run_checks``), and this process, outside both,
reads each run's output only as plain data and decides."""

from __future__ import annotations

import marshal
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from conf.schema import SandboxConfig
from environments import sandbox
from environments.judge import plain
from environments.judge.pairs import PairTest, defined_names, pair_test
from core import pyast

HERE = Path(__file__).parent
MAX_ROUNDS = 8
"""Most ``run_checks`` runs per response: a test whose next call needs the previous result (its
arguments or its control flow) resolves one round at a time; past this it is ``undecided``."""
ERRORS = ("not_plain", "bad_result", "undecided", "check_failed")
"""Why a response's judging is an error (it gets the fallback score, counted per reason): a result
that is not plain data, a result record that does not decode, a test still waiting after
``MAX_ROUNDS``, or the trusted check run failing."""


@dataclass(frozen=True)
class Judgement:
    """One response's judging: ``passed`` of ``total`` tests; ``reason``: one of ``ERRORS`` when
    the judging failed (then ``passed`` is 0)."""

    passed: int
    total: int
    reason: str | None = None


class Failed(Exception):
    """The judging of a response failed for ``reason`` (one of ``ERRORS``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Rounds:
    """One response's state between runs: the program's source, each test's pairs (None: checked in
    ``run_checks``) and the results: by (test, call number) for pairs, by the check run's (test,
    call key, occurrence) for the other tests."""

    source: str
    prefix: str
    entry: str | None
    tests: tuple[str, ...]
    pairs: list[PairTest | None]
    timeout_s: float
    config: SandboxConfig | None
    results: dict | None = None

    def run(self) -> Judgement:
        self.results = {}
        queue = [((i, k), c) for i, p in enumerate(self.pairs) if p for k, c in enumerate(p.calls)]
        status = {i: "pending" for i, p in enumerate(self.pairs) if p is None}
        rounds = 0
        if status:
            queue += self.check(status)
            rounds += 1
        while queue:
            self.compute(queue)
            queue = []
            if "pending" in status.values():
                if rounds >= MAX_ROUNDS:
                    raise Failed("undecided")
                queue = self.check(status)
                rounds += 1
        if "pending" in status.values():
            raise Failed("undecided")
        passed = sum(status.get(i) == "pass" or self.pair_holds(i, p) for i, p in enumerate(self.pairs))
        return Judgement(passed, len(self.tests))

    def pair_holds(self, i: int, p: PairTest | None) -> bool:
        if p is None:
            return False
        return p.holds([_value(self.results[(i, k)]) for k in range(len(p.calls))])

    def compute(self, queue: list) -> None:
        """Stage 1: the program on ``queue``'s calls ((test, k), (name, args, kwargs)), in one run."""
        calls = [[name, plain.encode(list(args)), plain.encode(kwargs)] for _, (name, args, kwargs) in queue]
        files = {
            "_judge_plain.py": script("plain.py"),
            "calls.bin": marshal.dumps(calls),
            "solution.py": self.source,
        }
        out = sandbox.run(script("run_calls.py"), files=files, timeout_s=self.timeout_s, config=self.config)
        got = read_results(out.stdout, len(queue))
        for (key, _), record in zip(queue, got):
            if "not_plain" in record:
                raise Failed("not_plain")
            self.results[key] = record

    def check(self, status: dict) -> list:
        """Stage 2: the tests still pending, on the results known so far, in a fresh run; updates
        ``status`` and returns the calls they need next."""
        known = [[*key, _canonical(r)] for key, r in self.results.items() if len(key) == 3]
        job = {
            "prefix": self.prefix,
            "entry_point": self.entry,
            "tests": [src if status.get(i) == "pending" else "pass" for i, src in enumerate(self.tests)],
            "known": known,
        }
        files = {"_judge_plain.py": script("plain.py"), "checks.bin": marshal.dumps(job)}
        out = sandbox.run(script("run_checks.py"), files=files, timeout_s=self.timeout_s, config=self.config)
        lines = [pyast.literal_eval(x) for x in out.stdout.splitlines() if x.startswith("{")]
        if not lines or "pending" not in lines[-1] or not out.ok:
            raise Failed("check_failed")
        for line in lines[:-1]:
            if line["test"] in status:
                status[line["test"]] = line["status"]
        return [
            ((i, key, n), (name, plain.decode(args), plain.decode(kwargs)))
            for i, key, n, name, args, kwargs in lines[-1]["pending"]
        ]


@cache
def script(name: str) -> str:
    """The source of one of this package's files shipped into the sandbox."""
    return (HERE / name).read_text()


def read_results(stdout: str, n: int) -> list[dict]:
    """The ``n`` call records of a ``run_calls`` run's output, read as untrusted data (Python literals,
    ``ast.literal_eval``: never code): a line that is not a record is skipped, the first record of
    each call counts, a call with none has ``{"raised": "NoResult"}``; a value that does not decode as
    plain data raises ``bad_result``."""
    out: list[dict | None] = [None] * n
    for line in stdout.splitlines():
        try:
            rec = pyast.literal_eval(line) if line.startswith("{") else None
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        i = rec.get("i") if type(rec) is dict else None
        if type(i) is not int or not 0 <= i < n or out[i] is not None:
            continue
        if "v" in rec:
            try:
                out[i] = {"v": plain.decode(rec["v"])}
            except (ValueError, RecursionError):
                raise Failed("bad_result") from None
        elif "not_plain" in rec:
            out[i] = {"not_plain": str(rec["not_plain"])[:40]}
        else:
            out[i] = {"raised": str(rec.get("raised"))[:40]}
    return [r if r is not None else {"raised": "NoResult"} for r in out]


def _value(record: dict):
    return record["v"] if "v" in record else RuntimeError(record.get("raised"))


def _canonical(record: dict) -> dict:
    """A result as this process re-encodes it for the check run (the program's bytes never pass)."""
    return {"v": plain.encode(record["v"])} if "v" in record else {"raised": record["raised"]}


def judge(program: str, spec, timeout_s: float, config: SandboxConfig | None = None) -> Judgement:
    """``program`` against ``spec`` (a ``environments.code.CodeSpec``): its tests passed, or the
    reason the judging failed. Each sandbox run has the wall limit ``timeout_s``."""
    prefix = spec.prefix
    names = defined_names(prefix)
    rounds = Rounds(
        source=prefix + ("\n" if prefix else "") + program,
        prefix=prefix,
        entry=spec.entry_point,
        tests=tuple(spec.tests),
        pairs=[pair_test(t, spec.entry_point, names) for t in spec.tests],
        timeout_s=timeout_s,
        config=config,
    )
    try:
        return rounds.run()
    except Failed as e:
        return Judgement(0, len(spec.tests), e.reason)
