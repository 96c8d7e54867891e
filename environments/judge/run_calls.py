"""Stage 1, the only process the program runs in: ``main.py`` of an untrusted sandbox run. Standard
library only (shipped into the sandbox with ``plain.py`` as ``_judge_plain.py``).

It reads the calls (``calls.bin``: ``marshal`` of ``[[name, args, kwargs], ...]`` in ``plain``
encoding, written by the checker) before the program loads, moves the program's stdout onto stderr,
loads ``solution.py`` (the prefix and the program) as module ``solution``, then calls each named
function on fresh copies of its arguments and writes one line per call on the saved stdout, a
Python literal (``repr``; no ``json``: its import would add 20-40 ms to every run):
``{'i': k, 'v': value}``, ``{'i': k, 'raised': type name}`` or ``{'i': k, 'not_plain': type name}``.

Nothing here is trusted: the program shares this process and may patch anything in it, write its
own lines, or exit. It never sees an expected output, so whatever it writes is at most its own
answer, which the checker outside decodes as plain data and compares."""

from __future__ import annotations


def main() -> None:
    import marshal
    import os
    import sys

    plain = load_plain()

    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the program's prints go to stderr; the results' channel is the saved stdout
    with open("calls.bin", "rb") as f:
        calls = marshal.loads(f.read())
    ns = {"__name__": "solution"}
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
    except BaseException as e:  # noqa: BLE001 - a crash while loading leaves what it defined
        print(f"the program failed to load: {type(e).__name__}", file=sys.stderr)
    for i, (name, args, kwargs) in enumerate(calls):
        try:
            fn = ns[name] if name in ns else _undefined
            record = {"i": i, "v": plain.encode(fn(*plain.decode(args), **plain.decode(kwargs)))}
        except plain.NotPlain as e:
            record = {"i": i, "not_plain": e.reason}
        except BaseException as e:  # noqa: BLE001 - SystemExit too: the call failed, the run goes on
            record = {"i": i, "raised": _name(e)}
        out.write(repr(record) + "\n")
        out.flush()


def _undefined(*args, **kwargs):
    raise NameError("the program does not define the function the test calls")


def _name(e: BaseException) -> str:
    try:
        return str(type(e).__name__)[:40]
    except BaseException:  # noqa: BLE001 - a hostile metaclass
        return "Exception"


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
