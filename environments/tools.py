"""Tools an episode can call. Each is a plain object with ``name``, ``description`` and
``__call__(arguments: str) -> str`` (the observation text)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pathlib import Path

from conf.schema import SandboxConfig
from environments import calculator, sandbox
from environments.base import ToolError
from environments.sandbox import SandboxResult

LIMIT_NAMES = {
    "wall": "the wall-clock timeout",
    "cpu": "the CPU time limit",
    "memory": "the memory limit",
    "output": "the output limit",
    "processes": "the process limit",
    "file_size": "the file size limit",
    "signal": "a signal",
}


def observation(result: SandboxResult, max_chars: int) -> str:
    """What the policy sees of a run: its stdout; on failure, also how it ended and the end of stderr."""
    out = result.stdout
    if not result.ok:
        how = (
            f"killed by {LIMIT_NAMES[result.killed_by]}"
            if result.killed_by
            else f"exit status {result.exit_code}"
        )
        out = f"{out.rstrip(chr(10))}\n[{how}]\n{result.stderr[-max_chars:]}".lstrip("\n")
    if len(out) > max_chars:
        out = out[: max_chars // 2] + "\n...[cut]...\n" + out[-max_chars // 2 :]
    return out.strip("\n") + "\n" if out.strip() else "[no output]\n"


def code_of(arguments: str) -> str:
    """The program in a call's arguments: ``{"code": "..."}`` (a tool-call JSON) or the code itself."""
    text = arguments.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return arguments
        if isinstance(parsed, dict) and isinstance(parsed.get("code"), str):
            return parsed["code"]
    return arguments


@dataclass(frozen=True)
class PythonTool:
    """Runs a Python program in the sandbox (``environments.sandbox.run``) and returns its output."""

    config: SandboxConfig = field(default_factory=SandboxConfig)
    max_chars: int = 2000
    """Longest observation, in characters (the middle of a longer one is cut)."""
    name: str = "python"
    description: str = (
        "Run a Python 3 program (standard library only; no network, no files but its own) and return "
        'what it prints. Arguments: the program, or {"code": "..."}.'
    )

    def __call__(self, arguments: str) -> str:
        return observation(sandbox.run(code_of(arguments), config=self.config), self.max_chars)


python_tool = PythonTool()
"""The Python tool with the default sandbox configuration."""


CALC_MAIN = """import sys, types
base = types.ModuleType("environments.base")
exec("class ToolError(Exception):\\n    pass\\n", base.__dict__)
sys.modules["environments"] = types.ModuleType("environments")
sys.modules["environments.base"] = base
calc = {"__name__": "calculator"}
exec(compile(open("calculator.py").read(), "calculator.py", "exec"), calc)
try:
    print("ok", calc["render"](calc["evaluate"](open("expression.txt").read())))
except base.ToolError as e:
    print("error", e)
"""
"""The sandbox's ``main.py`` for ``SandboxCalculator``: the calculator module's own source, loaded with
a stand-in for ``environments.base``, evaluates the expression file and prints ``ok VALUE`` or
``error WHY``."""


@dataclass(frozen=True)
class SandboxCalculator:
    """The calculator (``environments.calculator``) evaluated in the sandbox: each call is one
    ``environments.sandbox.run`` of the calculator module's own source on the call's expression, so
    the model's text runs only in the sandbox and a call costs a real sandboxed execution."""

    config: SandboxConfig = field(default_factory=SandboxConfig)
    name: str = calculator.Calculator.name
    description: str = calculator.Calculator.description

    def __call__(self, arguments: str) -> str:
        files = {"calculator.py": Path(calculator.__file__).read_text(), "expression.txt": arguments}
        result = sandbox.run(CALC_MAIN, files=files, config=self.config)
        kind, _, text = result.stdout.strip().partition(" ")
        if result.ok and kind == "ok":
            return text
        if result.ok and kind == "error":
            raise ToolError(text)
        raise ToolError(observation(result, 200).strip())
