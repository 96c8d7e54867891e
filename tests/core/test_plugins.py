"""core.plugins: targets by import path, parameters validated by the plug-in's own model, one-line errors."""

import sys
import textwrap

import pytest

from core import plugins


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    root = tmp_path / "plugpkg_core"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "rewards.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel, Field

            class Params(BaseModel):
                k: int = Field(3, ge=1)

            def brevity(sample):
                return 1.0

            brevity.Params = Params

            def bare(sample):
                return 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "plugpkg_core.rewards"
    for name in [m for m in sys.modules if m.startswith("plugpkg_core")]:
        del sys.modules[name]


def test_a_target_loads_and_its_params_validate_into_its_model(pkg):
    obj = plugins.load(f"{pkg}:brevity")
    assert obj(None) == 1.0
    assert plugins.validate_params(f"{pkg}:brevity", obj, {"k": 5}).k == 5
    assert plugins.validate_params(f"{pkg}:brevity", obj, None).k == 3


@pytest.mark.parametrize(
    ("params", "words"),
    [({"k": 0}, "params.k: Input should be greater than or equal to 1"), ({"z": 1}, "unknown params ['z']")],
)
def test_bad_params_are_one_line_naming_the_target(pkg, params, words):
    obj = plugins.load(f"{pkg}:brevity")
    with pytest.raises(plugins.PluginError) as e:
        plugins.validate_params(f"{pkg}:brevity", obj, params)
    assert words in str(e.value) and f"{pkg}:brevity" in str(e.value) and "\n" not in str(e.value)


def test_params_for_a_plugin_without_a_model_are_refused(pkg):
    with pytest.raises(plugins.PluginError, match="declares no Params"):
        plugins.validate_params(f"{pkg}:bare", plugins.load(f"{pkg}:bare"), {"k": 1})


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("plugpkg_core.rewards:nope", "has no attribute 'nope'"),
        ("no_such_pkg_xyz.mod:f", "cannot be imported: ModuleNotFoundError"),
        ("not a target", "is not an import path"),
    ],
)
def test_a_target_that_cannot_load_is_one_line_naming_it(pkg, target, words):
    with pytest.raises(plugins.PluginError) as e:
        plugins.load(target)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_source_record_hashes_the_file_as_it_is_now(pkg, tmp_path):
    first = plugins.source_record(f"{pkg}:brevity")
    assert first["path"].endswith("rewards.py") and len(first["sha256"]) == 64
    path = tmp_path / "plugpkg_core" / "rewards.py"
    path.write_text(path.read_text() + "\n# edited\n")
    assert plugins.source_record(f"{pkg}:brevity")["sha256"] != first["sha256"]


def test_short_names_resolve_with_a_did_you_mean():
    assert plugins.resolve_name("rewards", "a.b:c", {}) == "a.b:c"
    assert plugins.resolve_name("rewards", "math_verify", {"math_verify": "x.y:z"}) == "x.y:z"
    with pytest.raises(plugins.PluginError, match="did you mean 'math_verify'"):
        plugins.resolve_name("rewards", "math_verfy", {"math_verify": "x.y:z"})


def test_the_signature_is_checked(pkg):
    obj = plugins.load(f"{pkg}:brevity")
    assert plugins.check_callable("t", obj, 1) is obj
    with pytest.raises(plugins.PluginError, match="wrong signature"):
        plugins.check_callable("t", obj, 2)
    with pytest.raises(plugins.PluginError, match="must be an async def"):
        plugins.check_callable("t", obj, 1, is_async=True)
