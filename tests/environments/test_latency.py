"""Tool-call latency: the sampler is seeded per call and hits the published points, its parameters are
validated at compose time, and it stays out of cache keys while off (episodes under latency:
tests/environments/test_episodes.py)."""

import pytest
import yaml

from conf.loader import load_config
from conf.schema import CODEX_EXEC_LATENCY, Config, ConfigError, ToolLatencyConfig, validate
from environments.latency import LatencySampler
from tasks.stages.common import env_key as _env_key


def test_a_draw_is_a_function_of_seed_and_call_key():
    s = LatencySampler(ToolLatencyConfig(kind="codex_exec"))
    assert s.sample("q1|0|0|r0t1") == s.sample("q1|0|0|r0t1")
    other_seed = LatencySampler(ToolLatencyConfig(kind="codex_exec", seed=1))
    draws = [s.sample(f"k{i}") for i in range(50)]
    assert draws != [other_seed.sample(f"k{i}") for i in range(50)]
    assert len(set(draws)) == 50 and all(0.02 <= x <= 30.0 for x in draws)


def test_codex_exec_hits_the_published_quantiles_and_the_tail_scale_stretches_above_the_median():
    s = LatencySampler(ToolLatencyConfig(kind="codex_exec"))
    for p, sec in zip(*CODEX_EXEC_LATENCY):
        assert s.quantile(p) == pytest.approx(sec)
    draws = sorted(s.sample(f"c{i}") for i in range(4000))
    assert draws[2000] == pytest.approx(0.16, rel=0.05) and draws[3960] == pytest.approx(8.6, rel=0.25)
    for scale in (0.5, 2.0):
        t = LatencySampler(ToolLatencyConfig(kind="codex_exec", tail_scale=scale))
        assert t.quantile(0.5) == pytest.approx(0.16)
        assert t.quantile(0.99) == pytest.approx(0.16 + scale * (8.6 - 0.16))
        assert t.quantile(0.25) == s.quantile(0.25)  # the body below the median is untouched


def test_fixed_and_lognormal():
    assert LatencySampler(ToolLatencyConfig(kind="fixed", seconds=[0.4])).sample("x") == 0.4
    ln = LatencySampler(ToolLatencyConfig(kind="lognormal", median_s=0.5, sigma=1.0))
    assert ln.quantile(0.5) == pytest.approx(0.5)
    assert ln.quantile(0.8413447) == pytest.approx(0.5 * 2.718281828, rel=1e-4)
    assert LatencySampler(ToolLatencyConfig()).sample("x") == 0.0


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["env.tool_latency.kind=codex_exec"], "single-turn episode calls no tool"),
        (["env=calculator", "env.tool_latency.kind=gamma"], "is not supported"),
        (["env=calculator", "env.tool_latency.kind=fixed"], "needs one value"),
        (
            ["env=calculator", "env.tool_latency.kind=quantiles", "env.tool_latency.seconds=[1,2]"],
            "one length",
        ),
        (
            ["env=calculator", "env.tool_latency.kind=quantiles"]
            + ["env.tool_latency.probs=[0,0.7,0.5,1]", "env.tool_latency.seconds=[1,2,3,4]"],
            "rise strictly",
        ),
        (
            ["env=calculator", "env.tool_latency.kind=quantiles"]
            + ["env.tool_latency.probs=[0,1]", "env.tool_latency.seconds=[2,1]"],
            "non-decreasing",
        ),
        (["env=calculator", "env.tool_latency.kind=codex_exec", "env.tool_latency.tail_scale=-1"], ">= 0"),
        (["env=calculator", "env.tool_latency.kind=lognormal", "env.tool_latency.median_s=0"], "> 0"),
        (["env=calculator", "env.tool_latency.probs=[0,1.5]"], "[0, 1]"),
    ],
)
def test_bad_latency_settings_fail_at_compose_time(overrides, says):
    with pytest.raises(ConfigError) as err:
        validate(_config(overrides))
    assert says in str(err.value) and "env.tool_latency" in str(err.value)


def test_a_latency_typo_fails_through_the_config_loader():
    with pytest.raises(ConfigError, match="env.tool_latency.kind"):
        load_config(["env=calculator", "env.tool_latency.kind=gamma"])


def test_latency_off_by_default_and_absent_from_cache_keys_while_off():
    assert Config().env.tool_latency.is_off()
    assert "tool_latency" not in _env_key(_config(["env=calculator"]))["env"]
    on = _config(["env=calculator", "env.tool_latency.kind=codex_exec"])
    assert _env_key(validate(on))["env"]["tool_latency"]["kind"] == "codex_exec"
    assert _env_key(Config()) == {}


def _config(overrides: list[str]) -> Config:
    """A Config from ``env=NAME`` and ``env.tool_latency.KEY=VALUE`` overrides, without Hydra."""
    env, lat = {"max_turns": 3}, {}
    for o in overrides:
        key, value = o.split("=", 1)
        parsed = yaml.safe_load(value)
        if key == "env":
            env["target"] = value
        else:
            lat[key.removeprefix("env.tool_latency.")] = parsed
    return validate({"env": {**({"max_turns": 1} if "target" not in env else env), "tool_latency": lat}})
