from pathlib import Path

import pytest

from conf.loader import CONF_DIR, load_config
from conf.schema import Config, ConfigError


def group_options():
    for group_dir in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for yaml in sorted(group_dir.glob("*.yaml")):
            yield group_dir.name, yaml.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_shipped_option_composes(group, option, tmp_path):
    extra = [f"model.path={tmp_path}"] if (group, option) == ("model", "hf") else []
    cfg = load_config([f"{group}={option}", *extra])
    assert isinstance(cfg, Config)


def test_default_is_typed_and_valid():
    cfg = load_config([])
    assert cfg.model.kind == "tiny" and cfg.rl.algorithm == "grpo" and cfg.rl.mode == "sync"
    assert isinstance(cfg.rl.lr, float) and cfg.eval.benchmarks == ["arith_heldout"]


def test_overrides_apply_with_types():
    cfg = load_config(["rl.lr=0.001", "seed=3", "data.levels=[1,2]"])
    assert cfg.rl.lr == pytest.approx(0.001) and cfg.seed == 3 and cfg.data.levels == [1, 2]


@pytest.mark.parametrize("overrides,fragment", [
    (["no_such_key=1"], "unknown config key 'no_such_key'"),
    (["rl.no_such=1"], "unknown config key 'rl.no_such'"),
    (["+foo=1"], "unknown config key 'foo'"),
    (["rl.lr=fast"], "rl.lr"),
    (["seed=abc"], "seed"),
    (["model=nope"], "model=nope: choose one of hf, tiny"),
    (["model=hf"], "model.path=DIR"),
    (["rl.group_size=1"], "rl.group_size"),
    (["rl.mode=turbo"], "rl.mode='turbo' is not supported"),
    (["data.levels=[9]"], "data.levels"),
    (["model.num_heads=3"], "model.hidden_size=128 must be divisible by model.num_heads=3"),
])
def test_bad_config_fails_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert fragment in str(err.value)


def test_yaml_tree_has_no_stray_keys():
    # every key a YAML file sets exists in the schema: loading each file alone would fail otherwise
    for path in Path(CONF_DIR).rglob("*.yaml"):
        assert path.read_text().strip(), path
