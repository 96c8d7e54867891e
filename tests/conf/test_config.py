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


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["no_such_key=1"], "unknown config key 'no_such_key'"),
        (["rl.no_such=1"], "unknown config key 'rl.no_such'"),
        (["+foo=1"], "unknown config key 'foo'"),
        (["rl.lr=fast"], "rl.lr"),
        (["seed=abc"], "seed"),
        (["model=nope"], "model=nope: choose one of hf, tiny"),
        (["model=hf"], "model.path=DIR"),
        (["rl.group_size=1"], "rl.group_size"),
        (["rl.admit_lag=0"], "rl.admit_lag"),
        (["rl.admit_lag=3"], "rl.admit_lag=3 > rl.max_staleness=1"),
        (["curation.select.round_headroom=0.5"], "round_headroom"),
        (["curation.select.greso_easy_threshold=0.1"], "greso_hard_threshold < greso_easy_threshold"),
        (["curation.select.history_prompts=-1"], "curation.select.history_prompts"),
        (["rl.mode=turbo"], "rl.mode='turbo' is not supported"),
        (["rl.dynamic_sampling=maybe"], "config key 'rl.dynamic_sampling'"),
        (["+rl.foo=1"], "unknown config key 'rl.foo'"),
        (["data.levels=[9]"], "data.levels"),
        (["model.num_heads=3"], "model.hidden_size=128 must be divisible by model.num_heads=3"),
    ],
)
def test_bad_config_fails_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert fragment in str(err.value)


def test_yaml_tree_sets_only_schema_keys():
    import dataclasses

    import yaml

    groups = {
        f.name: f.default_factory()
        for f in dataclasses.fields(Config)
        if f.default_factory is not dataclasses.MISSING
    }

    def check(node, data, where):
        known = {f.name: f for f in dataclasses.fields(node)}
        assert set(data) <= set(known), (where, set(data) - set(known))
        for key, value in data.items():
            sub = getattr(node, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(sub):
                check(sub, value, f"{where}.{key}")

    for group, option in group_options():
        text = (Path(CONF_DIR) / group / f"{option}.yaml").read_text()
        data = yaml.safe_load(text) or {}
        if "@package _global_" in text:  # a preset that sets keys of several groups
            check(Config(), data, f"{group}/{option}")
        else:
            check(groups[group], data, f"{group}/{option}")


def test_preflight_catches_what_needs_files(tmp_path):
    from tasks.preflight import preflight

    with pytest.raises(ConfigError, match="eval.benchmarks: unknown benchmark 'gsm8kk'"):
        preflight(load_config(["eval.benchmarks=[gsm8kk]"]))
    with pytest.raises(ConfigError, match="curation.decontam.benchmarks: unknown benchmark 'aime2024'"):
        preflight(load_config(["curation.decontam.benchmarks=[aime24,aime2024]"]))
    with pytest.raises(ConfigError, match="paraphrase_moderate=0.95 and paraphrase_high=0.92"):
        load_config(["curation.decontam.paraphrase_moderate=0.95"])
    with pytest.raises(ConfigError, match=r"curation.templates.min_share=0.0 must be in \(0, 1\]"):
        load_config(["curation.templates.min_share=0"])
    with pytest.raises(ConfigError, match="no config.json"):
        preflight(load_config(["model=hf", f"model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match="rl.overlong_cache_len=16 must be in"):
        preflight(load_config(["rl.algorithm=dapo", "rl.max_new_tokens=16"]))
    preflight(load_config(["rl.max_new_tokens=16"]))  # grpo: no shaping, no constraint
    preflight(load_config(["eval.benchmarks=[arith_heldout,gsm8k]"]))


def test_rollout_engines_are_the_engine_kinds():
    from conf.schema import ROLLOUT_ENGINES
    from generation.engines import ENGINE_KINDS

    assert set(ROLLOUT_ENGINES) == set(ENGINE_KINDS)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.backend=jax"], "trainer.backend"),
        (["trainer.ranks=0"], "trainer.ranks"),
        (["trainer.backend=deepspeed", "rl.runtime=local"], "Ray runtime"),
        (["cluster.trainer_strategy=RANDOM"], "cluster.trainer_strategy"),
        (["cluster.rollout_priority=high"], "cluster.rollout_priority"),
        (["rollout.engine=vllm"], "refuses head_dim=16.*model=tiny_vllm"),
        (["rollout.engine=sglang"], "rollout.engine"),
    ],
)
def test_trainer_and_rollout_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides)


def test_a_deepspeed_or_multi_rank_trainer_runs_on_ray():
    assert load_config(["trainer.backend=deepspeed"]).rl.runtime == "ray"
    assert load_config(["trainer.ranks=2"]).rl.runtime == "ray"
    assert load_config([]).rl.runtime == "auto"


def test_an_unknown_deepspeed_config_fails_in_preflight(tmp_path):
    from tasks.preflight import preflight

    with pytest.raises(ConfigError, match="trainer.deepspeed='zero9'.*zero2, zero3"):
        preflight(load_config(["trainer.backend=deepspeed", "trainer.deepspeed=zero9"]))
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        preflight(load_config(["trainer.backend=deepspeed", f"trainer.deepspeed={bad}"]))
    preflight(load_config(["trainer.backend=deepspeed", "trainer.deepspeed=zero3"]))
