"""Stage 2, a fresh process the program never ran in: ``main.py`` of the sandbox run that evaluates
tests which are not plain input/output pairs (HumanEval's ``check`` with loops, helpers, tolerances).
Standard library only (shipped into the sandbox with ``plain.py`` as ``_judge_plain.py``).

``checks.bin`` (``marshal``, written by the checker) holds the problem's prefix (trusted problem
code: HumanEval's prompt and its helper functions, run here), the entry point, the tests and
``known``: the program's results so far, each keyed by (test, call key: the function's name and
arguments as a literal, occurrence). Each test runs with every name it uses but does not define (and
the entry point) bound to a ``Proxy``: a call returns the known plain result (or raises the
program's exception), or, when none is known yet, records the call as pending and returns
``UNKNOWN``, whose every use raises ``Pending``; ``assert`` statements are wrapped so that a
``Pending`` skips only that statement, and the test runs on to collect more calls. Output, one
Python literal a line on the saved stdout: ``{'test': i, 'status': 'pass' | 'fail' | 'pending',
'why': ...}`` per test, then ``{'pending': [[test, key, occurrence, name, args, kwargs], ...]}``.
The checker outside runs the program on the pending calls (stage 1) and this again, until no test
is pending. A test whose calls are not deterministic keeps asking (``undecided``)."""

from __future__ import annotations

import ast


class Pending(BaseException):  # noqa: N818 - raised, not an error: the test needs a result not yet computed
    """A test used a result not computed yet."""


class ProgramError(Exception):
    """The program raised (an exception this process has no class of), gave no result or no plain one."""


def _pending(*args, **kwargs):
    raise Pending()


class Unknown:
    """A result not computed yet: any use of it raises ``Pending``."""

    __slots__ = ()


for _op in (
    "eq ne lt le gt ge bool len iter next reversed contains getitem setitem delitem hash int float "
    "index complex abs neg pos invert round trunc floor ceil str repr format bytes getattr call "
    "enter exit add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or"
).split():
    setattr(Unknown, f"__{_op}__", _pending)
    if _op in "add sub mul matmul truediv floordiv mod divmod pow lshift rshift and xor or".split():
        setattr(Unknown, f"__r{_op}__", _pending)
UNKNOWN = Unknown()


class WrapAsserts(ast.NodeTransformer):
    """``assert X`` -> ``try: assert X`` ``except Pending: pass``, at any depth."""

    def visit_Assert(self, node: ast.Assert) -> ast.Try:
        handler = ast.ExceptHandler(type=ast.Name("_judge_Pending", ast.Load()), name=None, body=[ast.Pass()])
        return ast.Try(body=[node], handlers=[handler], orelse=[], finalbody=[])


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads but binds nowhere (any scope): what the program must provide."""
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


class Calls:
    """One test's calls into the program, each named by its function, its arguments and how many
    equal calls came before it (so a result stays matched to its call whatever order the rounds
    discover calls in): known results replayed, the others recorded as pending."""

    def __init__(self, test: int, known: dict, pending: list, plain) -> None:
        self.test, self.known, self.pending, self.plain, self.seen = test, known, pending, plain, {}

    def __call__(self, name: str, args: tuple, kwargs: dict):
        import builtins

        try:
            enc = [self.plain.encode(list(args)), self.plain.encode(kwargs)]
        except self.plain.NotPlain as e:
            if e.reason == "Unknown":
                raise Pending() from None
            raise TypeError(f"the test passes {e.reason} (not plain data) to the program") from None
        key = repr([name, *enc])
        n = self.seen[key] = self.seen.get(key, -1) + 1
        record = self.known.get((self.test, key, n))
        if record is None:
            self.pending.append([self.test, key, n, name, enc[0], enc[1]])
            return UNKNOWN
        if "v" in record:
            return self.plain.decode(record["v"])
        kind = getattr(builtins, str(record.get("raised")), None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(f"raised by the program ({kind.__name__})")
        raise ProgramError(f"the program's call failed: {str(record)[:80]}")


class Proxy:
    """A function of the program, seen from the tests."""

    def __init__(self, name: str, calls: Calls) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *args, **kwargs):
        return self.calls(self.name, args, kwargs)


def run_test(i: int, src: str, base: dict, entry: str | None, known: dict, pending: list, plain):
    """(status, why) of test ``i``: ``pass``, ``fail`` or ``pending`` (it made calls not known yet).
    A name the test uses but does not define is the prefix's, a builtin, a standard-library module
    (a test may lean on the program's ``import math``), else the program's (a ``Proxy``)."""
    import builtins
    import sys

    try:
        tree = ast.fix_missing_locations(WrapAsserts().visit(ast.parse(src)))
        code = compile(tree, f"test_{i}", "exec")
    except (SyntaxError, ValueError) as e:
        return "fail", f"the test does not compile: {type(e).__name__}"
    ns = dict(base)
    calls = Calls(i, known, pending, plain)
    for name in free_names(tree) | ({entry} if entry else set()):
        if name != entry and (name in ns or hasattr(builtins, name)):
            continue
        if name != entry and name in sys.stdlib_module_names:  # ``math.isclose`` the program imported
            ns[name] = __import__(name)
        else:
            ns[name] = Proxy(name, calls)
    ns["_judge_Pending"] = Pending
    before = len(pending)
    try:
        exec(code, ns)
        status, why = "pass", None
    except Pending:
        status, why = "pending", None
    except BaseException as e:  # noqa: BLE001 - the test failed, whatever it raised
        status, why = "fail", type(e).__name__
    return ("pending", None) if len(pending) > before else (status, why)


def main() -> None:
    import marshal
    import os

    plain = load_plain()

    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tests' own prints go to stderr
    with open("checks.bin", "rb") as f:
        job = marshal.loads(f.read())
    if "random" in job["prefix"] or any("random" in t for t in job["tests"]):
        __import__("random").seed(0)  # an unseeded test draws the same inputs in every round
    base = {"__name__": "checks"}
    try:
        exec(compile(job["prefix"], "prefix.py", "exec"), base)
    except BaseException:  # noqa: BLE001, S110 - a prefix that does not run alone defines what it reached
        pass
    known = {(t, key, n): record for t, key, n, record in job["known"]}
    pending: list = []
    for i, src in enumerate(job["tests"]):
        status, why = run_test(i, src, base, job["entry_point"], known, pending, plain)
        out.write(repr({"test": i, "status": status, "why": why}) + "\n")
    out.write(repr({"pending": pending}) + "\n")
    out.flush()


def load_plain():
    """``plain.py``, shipped beside this script as ``_judge_plain.py``, as a module (read from the
    working folder, whatever the import path)."""
    import types

    mod = types.ModuleType("_judge_plain")
    with open("_judge_plain.py", encoding="utf-8") as f:
        exec(compile(f.read(), "_judge_plain.py", "exec"), mod.__dict__)
    return mod


if __name__ == "__main__":
    main()
