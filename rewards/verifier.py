"""Answer extraction, normalisation and verification: one verifier for rewards and evaluation.

A response is scored in three steps:

1. ``extract_answer`` takes the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), else the
   text after the last ``####``. No extractable answer scores as wrong, not as an error.
2. ``normalize_answer`` maps gold and prediction to one canonical string each. Equal strings are
   correct; two plain numbers are compared numerically. This fast path needs no subprocess and
   decides nearly every item of the vendored benchmarks.
3. Everything else goes to ``math_verify`` (``verify(parse(gold), parse(pred))``) in a pool of
   spawned worker processes, with a per-item wall-clock timeout. A worker that exceeds it is
   killed and the pool rebuilt, so a pathological answer can never stall or crash a batch: every
   item gets a ``Verdict``, with ``error`` set when it could not be scored normally.

math-verify's own timeouts use ``signal.alarm``, which only works on the main thread; the worker
calls it with those timeouts disabled and the pool enforces the limit instead.

Workers die with the process that owns the ``Verifier``, however it ends (SIGKILL, the OOM killer):
on Linux each worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and
elsewhere a watcher thread in the worker exits when the parent is gone. The kernel ties that signal
to the *thread* that started the worker, so the pool is always started from one long-lived thread
(``_spawn_thread``), never from a caller's thread that may end first.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from decimal import MAX_EMAX, MIN_EMIN, Decimal, localcontext

__all__ = [
    "Verdict",
    "Verifier",
    "extract_answer",
    "math_verify_equal",
    "normalize_answer",
    "verify_one",
]

TIMEOUT_ERROR = "timeout"
_POOL_START_TIMEOUT_S = 120.0
"""How long worker start-up may go without progress: while the workers keep using CPU (importing
math-verify on a loaded machine can take minutes) the wait goes on, up to ``_POOL_START_CAP_S``."""
_POOL_START_CAP_S = 1200.0
_MAX_ATTEMPTS = 2  # an item in flight when a worker dies twice is reported as a crash


@dataclass(frozen=True)
class Verdict:
    """The score of one response. ``error`` is None when the item was scored normally;
    otherwise ``correct`` is False and ``error`` says why ("timeout", "crash: ...")."""

    correct: bool
    pred: str | None
    error: str | None = None

    @property
    def reward(self) -> float:
        return 1.0 if self.correct else 0.0


# --------------------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def _braced(text: str, open_idx: int) -> str | None:
    """Content of the brace group opening at ``text[open_idx] == '{'``; None if never closed."""
    depth = 0
    for i in range(open_idx, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_idx + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    last = None
    for last in _BOX_RE.finditer(text):  # noqa: B007 - we want the final match
        pass
    if last is None:
        return None
    rest = text[last.end() :]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _braced(text, len(text) - len(stripped))
    if stripped and len(stripped) < len(rest):  # "\boxed 5": one token, up to whitespace or '$'
        return re.match(r"[^\s$]*", stripped).group(0)
    return None


_ANSWER_IS = re.compile(r"\b[Tt]he (?:final )?answer is:?\s*\$?([+-]?\d[\d,]*(?:\.\d+)?)")
"""An instruct model's closing sentence ("The answer is 12."): a number only, so prose never counts."""


def extract_answer(text: str) -> str | None:
    """The model's final answer in ``text``: the content of the last ``\\boxed{...}`` or
    ``\\fbox{...}`` (balanced braces), else the rest of the line after the last ``####``,
    else the number of the last "The answer is N" (what an instruct model told to end that way
    writes), else None. Empty answers count as None."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    idx = text.rfind("####")
    if idx >= 0:
        line = text[idx + 4 :].split("\n", 1)[0].strip()
        if line:
            return line
    said = _ANSWER_IS.findall(text)
    return said[-1] if said else None


# --------------------------------------------------------------------------- normalisation

_PLAIN_NUMBER = re.compile(r"([+-]?)(\d*)(?:\.(\d*))?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TEXT_WRAPPERS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mathrm", "\\mbox")
_CHOICE = re.compile(r"\(([A-Z])\)")
_WORDS = re.compile(r"[A-Za-z]+(?: [A-Za-z]+)*")


def _canonical_number(s: str) -> str | None:
    """Canonical form of a plain decimal number ("025" -> "25", "2.50" -> "2.5", "-0" -> "0"),
    or None when ``s`` is not one. Pure string work, so any number of digits is fine."""
    m = _PLAIN_NUMBER.fullmatch(s)
    if m is None or not (m.group(2) or m.group(3)):
        return None
    sign, whole, frac = m.group(1), m.group(2).lstrip("0") or "0", (m.group(3) or "").rstrip("0")
    body = f"{whole}.{frac}" if frac else whole
    return f"-{body}" if sign == "-" and body != "0" else body


def _unwrap_text(s: str) -> str:
    """``\\text{Monday}`` -> ``Monday`` when the wrapper spans the whole string."""
    while True:
        for wrapper in _TEXT_WRAPPERS:
            if s.startswith(wrapper + "{") and _braced(s, len(wrapper)) == s[len(wrapper) + 1 : -1]:
                s = s[len(wrapper) + 1 : -1].strip()
                break
        else:
            return s


def _format_float(x: float) -> str:
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return format(Decimal(repr(x)), "f")


def normalize_answer(ans: str | int | float | None) -> str:
    """One canonical string for an answer, so that equal answers compare equal as strings.

    Numbers: ``27.0`` -> "27", ``2.50`` -> "2.5", "025" -> "25", "1,000" -> "1000", "+5" -> "5".
    Strips ``$`` / ``\\$``, surrounding spaces, ``\\!``, a trailing period and a whole-string
    ``\\text{...}`` wrapper; "(C)" -> "C". Anything else (``\\frac{1}{2}``, "(1,2)", "B") is
    kept as it is, with whitespace runs collapsed to one space. None -> "".
    """
    if ans is None:
        return ""
    if isinstance(ans, float):
        s = _format_float(ans)
    else:
        s = str(ans)
    s = re.sub(r"\\!\s*", "", s).replace("{,}", ",")
    s = s.replace("\\$", "").replace("$", "").strip()
    s = _unwrap_text(s)
    if s.endswith("."):
        s = s[:-1].rstrip()
    s = " ".join(s.split())
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    number = _canonical_number(s)
    if number is not None:
        return number
    choice = _CHOICE.fullmatch(s)
    return choice.group(1) if choice else s


def _fast_decision(gold: str, pred: str) -> bool | None:
    """Decide equal strings, pairs of plain words (case-insensitive) and pairs of plain numbers
    without math-verify; None otherwise. Both arguments are already normalised."""
    if gold == pred:
        return True
    if _WORDS.fullmatch(gold) and _WORDS.fullmatch(pred):
        # math-verify reads "east" as the product e*a*s*t, equal to "seat": never send it words.
        return gold.casefold() == pred.casefold()
    if _canonical_number(gold) is None or _canonical_number(pred) is None:
        return None
    if "." not in gold and "." not in pred:
        return False  # distinct canonical integers
    with localcontext() as ctx:  # any number of digits: the default context overflows past 10**999999
        ctx.Emax, ctx.Emin = MAX_EMAX, MIN_EMIN
        a, b = Decimal(gold), Decimal(pred)
        return abs(a - b) <= Decimal("1e-9") * max(abs(a), abs(b))


# --------------------------------------------------------------------------- worker side


def _mv_parse(answer: str) -> list:
    from math_verify import parse

    if len(answer) > 1 and _WORDS.fullmatch(answer):
        answer = f"\\text{{{answer}}}"  # one symbol, not a product of letters
    parsed: list = []
    for wrapped in (f"\\boxed{{{answer}}}", f"${answer}$"):
        parsed = parse(wrapped, parsing_timeout=None)
        if any(not isinstance(p, str) for p in parsed):
            return parsed
    return parsed or [answer]


def math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify's judgement on two normalised answers (gold first: it is not symmetric).
    Runs in a pool worker; has no timeout of its own."""
    from math_verify import verify

    return bool(verify(_mv_parse(gold), _mv_parse(pred), timeout_seconds=None))


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Make this worker die when ``parent_pid`` (the process that owns the pool) does: Linux's
    ``PR_SET_PDEATHSIG`` (SIGKILL, delivered by the kernel even while the worker is busy in C code),
    elsewhere a daemon thread that polls the parent. Either way, a parent already gone by now
    (it died while this worker started) ends the worker at once."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent_pid:
        os._exit(1)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="verifier-parent-watch", daemon=True).start()


def _worker_init(parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    import logging

    import math_verify.grader
    import math_verify.parser

    # We pass timeouts of None on purpose; silence the once-per-process warning about it.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # The first parse builds the LaTeX grammar (about a second): pay it here, not in a deadline.
    math_verify_equal("\\frac{1}{2}", "0.5")


def _ping(delay_s: float) -> int:
    time.sleep(delay_s)
    return os.getpid()


# --------------------------------------------------------------------------- parent side


@dataclass
class _SlowItem:
    index: int
    gold: str
    pred: str
    attempts: int = 0


def _workers_cpu(pool: ProcessPoolExecutor) -> float:
    """CPU seconds the pool's worker processes have used so far (0 where unreadable)."""
    import psutil

    total = 0.0
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            t = psutil.Process(proc.pid).cpu_times()
            total += t.user + t.system
        except (psutil.Error, ValueError, AttributeError):
            continue
    return total


class Verifier:
    """Scores responses against gold answers; see the module docstring.

    ``timeout_s`` bounds the wall-clock time of one math-verify call; ``workers`` is the size of
    the process pool, started on the first item that needs it. ``compare`` is the picklable
    top-level function the workers run (math-verify by default). Not meant to be shared between
    threads concurrently: calls are serialised by a lock.
    """

    def __init__(
        self,
        timeout_s: float = 5.0,
        workers: int = 1,
        *,
        compare: Callable[[str, str], bool] = math_verify_equal,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s = float(timeout_s)
        self.workers = int(workers)
        self._compare = compare
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- public -------------------------------------------------------------------------

    def verify(self, response: str, gold: str | int | float) -> Verdict:
        """Score one response against its gold answer."""
        return self.verify_batch([response], [gold])[0]

    def verify_batch(self, responses: Sequence[str], golds: Sequence[str | int | float]) -> list[Verdict]:
        """Score each response against the gold answer at the same index; one ``Verdict`` per
        response, in order. Items the fast path cannot decide run in the worker pool."""
        if len(responses) != len(golds):
            raise ValueError(
                f"verify_batch needs one gold per response: got {len(responses)} responses "
                f"and {len(golds)} golds"
            )
        verdicts: list[Verdict | None] = [None] * len(responses)
        slow: list[_SlowItem] = []
        for i, (response, gold) in enumerate(zip(responses, golds)):
            pred = None
            try:
                raw = extract_answer(response)
                if raw is None:
                    verdicts[i] = Verdict(False, None, None)
                    continue
                pred = normalize_answer(raw)
                gold_n = normalize_answer(gold)
                if not gold_n:
                    verdicts[i] = Verdict(False, pred, "empty gold answer")
                    continue
                decided = _fast_decision(gold_n, pred)
            except Exception as exc:  # a verdict for every item, whatever the input
                verdicts[i] = Verdict(False, pred, f"error: {_describe(exc)}")
                continue
            if decided is None:
                slow.append(_SlowItem(i, gold_n, pred))
            else:
                verdicts[i] = Verdict(decided, pred, None)
        if slow:
            with self._lock:
                for index, verdict in self._run_slow(slow).items():
                    verdicts[index] = verdict
        return verdicts  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            self._kill_pool()

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the slow path ----------------------------------------------------------------

    def _run_slow(self, items: list[_SlowItem]) -> dict[int, Verdict]:
        """Run every item through the pool, at most ``workers`` in flight (so each starts at
        once and its deadline counts only its own run time)."""
        results: dict[int, Verdict] = {}
        pending = deque(items)
        inflight: dict[Future, tuple[_SlowItem, float]] = {}
        while pending or inflight:
            self._fill(pending, inflight)
            next_deadline = min(deadline for _, deadline in inflight.values())
            done, _ = wait(
                inflight,
                timeout=max(0.0, next_deadline - time.monotonic()),
                return_when=FIRST_COMPLETED,
            )
            broken = False
            for future in done:
                item, _ = inflight.pop(future)
                try:
                    ok = future.result()
                except BrokenProcessPool:
                    broken = True
                    self._retry_or_fail(item, pending, results)
                except Exception as exc:  # any worker exception is a crash verdict
                    results[item.index] = Verdict(False, item.pred, f"crash: {_describe(exc)}")
                else:
                    results[item.index] = Verdict(bool(ok), item.pred, None)
            if broken:
                for item, _ in inflight.values():
                    self._retry_or_fail(item, pending, results)
                inflight.clear()
                self._kill_pool()
                continue
            now = time.monotonic()
            expired = [f for f, (_, deadline) in inflight.items() if deadline <= now]
            if expired:
                for future in expired:
                    item, _ = inflight.pop(future)
                    results[item.index] = Verdict(False, item.pred, TIMEOUT_ERROR)
                # Innocent items that shared the killed pool rerun from scratch.
                pending.extendleft(reversed([item for item, _ in inflight.values()]))
                inflight.clear()
                self._kill_pool()
        return results

    def _fill(self, pending: deque, inflight: dict) -> None:
        """Submit pending items up to ``workers`` in flight. An item that was in flight when a
        worker died is a suspect and reruns alone, so a second death convicts only the culprit."""
        while pending and len(inflight) < self.workers:
            if inflight and (pending[0].attempts or any(item.attempts for item, _ in inflight.values())):
                return
            pool = self._ensure_pool()
            item = pending.popleft()
            try:
                future = pool.submit(self._compare, item.gold, item.pred)
            except BrokenProcessPool:
                pending.appendleft(item)
                self._kill_pool()
                continue
            inflight[future] = (item, time.monotonic() + self.timeout_s)

    @staticmethod
    def _retry_or_fail(item: _SlowItem, pending: deque, results: dict[int, Verdict]) -> None:
        item.attempts += 1
        if item.attempts >= _MAX_ATTEMPTS:
            results[item.index] = Verdict(False, item.pred, "crash: worker process died")
        else:
            pending.appendleft(item)

    def _ensure_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Started (and every worker spawned, in ``_warm_up``) on the long-lived spawn thread: the
            # workers' parent-death signal follows the thread that started them.
            self._pool = _spawn_thread().submit(self._start_pool).result()
        return self._pool

    def _start_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
            initargs=(os.getpid(),),
        )
        self._pool = pool
        self._warm_up(pool)
        return pool

    def _warm_up(self, pool: ProcessPoolExecutor) -> None:
        """Wait until every worker has started and imported math-verify, so that start-up time
        is never charged to an item's timeout."""
        seen: set[int] = set()
        start = time.monotonic()
        give_up = start + _POOL_START_TIMEOUT_S
        cpu = _workers_cpu(pool)
        while len(seen) < self.workers:
            futures = [pool.submit(_ping, 0.05) for _ in range(self.workers)]
            while True:
                done, not_done = wait(futures, timeout=max(0.0, min(give_up - time.monotonic(), 10.0)))
                if not not_done:
                    break
                now_cpu = _workers_cpu(pool)
                if now_cpu > cpu:  # still importing (a loaded machine): give it another window
                    cpu, give_up = (
                        now_cpu,
                        min(time.monotonic() + _POOL_START_TIMEOUT_S, start + _POOL_START_CAP_S),
                    )
                if time.monotonic() >= give_up:
                    self._kill_pool()
                    raise RuntimeError(
                        f"verifier worker pool did not start: no progress for {_POOL_START_TIMEOUT_S:.0f} s "
                        f"({time.monotonic() - start:.0f} s in all); "
                        "check that math-verify imports in a fresh interpreter"
                    )
            try:
                seen.update(f.result() for f in done)
            except BrokenProcessPool as exc:
                self._kill_pool()
                raise RuntimeError(
                    "verifier worker processes died while starting. Workers are spawned, so they "
                    "re-import the main module: run from a file (not stdin) and guard the entry "
                    "point with `if __name__ == '__main__':`"
                ) from exc

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for process in processes:
            if process.is_alive():
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(timeout=5.0)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_spawner: tuple[int, ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def _spawn_thread() -> ThreadPoolExecutor:
    """One thread per process that starts every verifier pool and lives as long as the process
    (a caller's thread, e.g. an in-run evaluation's, may end while the workers it started are still
    wanted, and with ``PR_SET_PDEATHSIG`` its end would kill them)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():  # none yet, or inherited by a fork
            _spawner = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="verifier-spawn"))
        return _spawner[1]


# --------------------------------------------------------------------------- convenience

_shared: Verifier | None = None
_shared_lock = threading.Lock()


def verify_one(response: str, gold: str | int | float) -> Verdict:
    """Score one response with a process-wide shared ``Verifier`` (default settings)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Verifier()
            atexit.register(_shared.close)
    return _shared.verify(response, gold)
