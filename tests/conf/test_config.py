from pathlib import Path

import pytest

from conf.loader import CONF_DIR, load_config
from conf.schema import Config, ConfigError, ModelConfig


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
        (["rl.stepz=1"], "unknown config key 'rl.stepz' (did you mean 'rl.steps'?)"),
        (["+rl.stepz=1"], "unknown config key 'rl.stepz' (did you mean 'rl.steps'?)"),
        (["data=math", "data.sources.0.pathh=x"], "sources[0].pathh' (did you mean 'data.sources[0].path'?)"),
        (["+foo=1"], "unknown config key 'foo'"),
        (["rl.lr=fast"], "rl.lr"),
        (["seed=abc"], "seed"),
        (["model=nope"], "model=nope: choose one of hf, smollm2, tiny"),
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
    import yaml
    from pydantic import BaseModel

    def check(model, data, where):
        known = model.model_fields
        assert set(data) <= set(known), (where, set(data) - set(known))
        for key, value in data.items():
            sub = known[key].annotation
            if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
                check(sub, value, f"{where}.{key}")

    for group, option in group_options():
        text = (Path(CONF_DIR) / group / f"{option}.yaml").read_text()
        data = yaml.safe_load(text) or {}
        data.pop("defaults", None)  # a recipe's choices of other groups (override /model: ...)
        if "@package _global_" in text:  # a preset that sets keys of several groups
            check(Config, data, f"{group}/{option}")
        else:
            check(Config.model_fields[group].annotation, data, f"{group}/{option}")


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


def _declared_fields(model=None, prefix=""):
    """(key, rule) of every name list and bound the schema declares on a field (or its list's items):
    a rule is ``("names", (...))`` or an ``annotated_types`` constraint."""
    import typing

    from annotated_types import Ge, Gt, Interval, Le, MaxLen
    from pydantic import BaseModel

    model = Config if model is None else model
    for name, info in model.model_fields.items():
        annotation = info.annotation
        args = typing.get_args(annotation)
        inner = [a for a in args if typing.get_origin(a) is typing.Annotated]  # list[Annotated[...]]
        for lit in [annotation, *args]:
            if typing.get_origin(lit) is typing.Literal:
                yield prefix + name, ("names", typing.get_args(lit))
        for meta in [*info.metadata, *(m for a in inner for m in a.__metadata__)]:
            if isinstance(meta, (Ge, Gt, Le, Interval, MaxLen)):
                yield prefix + name, meta
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _declared_fields(annotation, f"{prefix}{name}.")


def _with(key, value, whole=False):
    """The default config's mapping with ``key`` set to ``value`` (a list key to ``[value]``, unless
    ``whole``)."""
    data = Config.model_construct().model_dump()
    *parents, name = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[name] = [value] if isinstance(node[name], list) and not whole else value
    return data


def _field_default(key):
    node = Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node


DECLARED = list(_declared_fields())


def _rule_id(rule):
    return "names" if isinstance(rule, tuple) else repr(rule).replace(" ", "")


def _is_float(key):
    import typing

    *parents, name = key.split(".")
    model = Config
    for part in parents:
        model = model.model_fields[part].annotation
    annotation = model.model_fields[name].annotation
    return annotation is float or float in typing.get_args(annotation)


def test_the_schema_declares_names_and_bounds_for_the_keys_it_checks():
    from annotated_types import Ge, Gt

    keys = {key for key, _ in DECLARED}
    assert {"rl.mode", "rl.algorithm", "rollout.engine", "tracking.backends", "model.lora.stages"} <= keys
    assert sum(rule == Gt(0) for _, rule in DECLARED) >= 40
    assert sum(rule == Ge(0) for _, rule in DECLARED) >= 14


@pytest.mark.parametrize("key,rule", DECLARED, ids=[f"{k}-{_rule_id(r)}" for k, r in DECLARED])
def test_every_declared_rule_refuses_a_bad_value_naming_the_key(key, rule):
    from annotated_types import Ge, Gt, Interval, Le, MaxLen

    from conf.schema import validate

    whole = False
    shown_key = key if whole or not isinstance(_field_default(key), list) else f"{key}[0]"
    if isinstance(rule, tuple):
        names = ", ".join(rule[1])
        bad, message = "nope", f"{shown_key}='nope' is not supported; set {shown_key} to one of: {names}"
    elif isinstance(rule, MaxLen):  # one item or character too many
        shown_key = key
        most = rule.max_length
        default = _field_default(key)
        if isinstance(default, list):
            bad, whole = [default[0] if default else 1] * (most + 1), True
            message = f"{key} lists {most + 1:,} items; it takes at most {most:,}"
        else:
            bad = "x" * (most + 1)
            message = f"{key} is {most + 1:,} characters long; it takes at most {most:,}"
    else:
        shown = (lambda v: float(v)) if _is_float(key) else (lambda v: v)
        if isinstance(rule, Interval):
            lo = "[" if rule.ge is not None else "("
            hi = "]" if rule.le is not None else ")"
            low, high = (
                (rule.ge if rule.ge is not None else rule.gt),
                (rule.le if rule.le is not None else rule.lt),
            )
            bad = high if rule.lt is not None else high + 0.5
            message = f"{shown_key}={shown(bad)} must be in {lo}{low:g}, {high:g}{hi}"
        elif isinstance(rule, Le):
            bad = int(rule.le) + 1
            limit = f"{rule.le:,}"
            message = f"{shown_key}={shown(bad)} is above the limit of {limit}; set {shown_key} to at most "
            message += limit
        elif isinstance(rule, Gt):
            bad = rule.gt
            hint = f"; set {shown_key} to a positive value" if rule.gt == 0 else ""
            message = f"{shown_key}={shown(bad)} must be > {rule.gt}{hint}"
        else:
            assert isinstance(rule, Ge)
            bad = rule.ge - 1
            hint = f"; set {shown_key} to zero or a positive value" if rule.ge == 0 else ""
            message = f"{shown_key}={shown(bad)} must be >= {rule.ge}{hint}"
    with pytest.raises(ConfigError) as err:
        validate(_with(key, bad, whole))
    assert str(err.value).startswith(message), (str(err.value), message)
    if not isinstance(rule, (tuple, MaxLen)) and _is_float(key):  # inf and nan fail before the bound
        with pytest.raises(
            ConfigError, match=f"{key}=inf is not a finite number; set {key} to a finite value"
        ):
            validate(_with(key, float("inf")))


def test_every_tracking_backend_has_its_module_and_install_line():
    import typing

    from conf.schema import TRACKING_BACKENDS, TrackingBackend

    assert set(TRACKING_BACKENDS) == set(typing.get_args(TrackingBackend))


def test_a_source_format_is_checked_in_every_listed_source():
    from conf.schema import SourceConfig

    with pytest.raises(ConfigError, match=r"data.sources\[1\].format='csv' is not supported"):
        load_config(
            [
                "data.source=files",
                "data.sources=[{name: a, path: a.jsonl}, {name: b, path: b.csv, format: csv}]",
            ]
        )
    assert SourceConfig().format == "auto"


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


def test_critic_settings_fail_before_any_write(tmp_path):
    from generation.model import build_char_tokenizer, build_tiny_model, save_model
    from tasks.preflight import preflight
    from tests.training.rl_fakes import MICRO

    with pytest.raises(ConfigError, match=r"rl.gae_lambda=1.5 must be in \[0, 1\]"):
        load_config(["rl.algorithm=ppo", "rl.gae_lambda=1.5"])
    with pytest.raises(ConfigError, match="rl.value_coef=-0.5 must be >= 0"):
        load_config(["rl.algorithm=ppo", "rl.value_coef=-0.5"])
    with pytest.raises(ConfigError, match="rl.value_warmup_steps=60 >= rl.steps=60"):
        load_config(["rl.algorithm=vapo", "rl.value_warmup_steps=60"])
    with pytest.raises(ConfigError, match="has no critic"):
        preflight(load_config(["rl.algorithm=grpo", f"rl.critic_path={tmp_path}"]))
    other = build_char_tokenizer("0123456789+-=")
    save_model(build_tiny_model(MICRO, other, seed=0), other, tmp_path / "critic")
    with pytest.raises(ConfigError, match="does not fit the policy's tokenizer: its tokenizer differs"):
        preflight(load_config(["rl.algorithm=ppo", f"rl.critic_path={tmp_path / 'critic'}"]))
    same = build_char_tokenizer()
    save_model(build_tiny_model(MICRO, same, seed=0), same, tmp_path / "fits")
    preflight(load_config(["rl.algorithm=ppo", f"rl.critic_path={tmp_path / 'fits'}"]))
    with pytest.raises(ConfigError, match="value_warmup_steps=3 pre-trains a critic"):
        preflight(load_config(["rl.algorithm=grpo", "rl.value_warmup_steps=3"]))
    for algorithm in ("ppo", "vapo", "rloo", "reinforce_pp", "gspo"):
        preflight(load_config([f"rl.algorithm={algorithm}"]))


def test_a_hugging_face_model_vllm_cpu_refuses_fails_before_any_write(tmp_path):
    from generation.model import build_char_tokenizer, build_tiny_model, save_model
    from tasks.preflight import preflight

    tok = build_char_tokenizer()
    for head_dim in (16, 32):
        shape = ModelConfig(
            hidden_size=2 * head_dim, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1
        )
        save_model(build_tiny_model(shape, tok, seed=0), tok, tmp_path / f"d{head_dim}")
    hf = ["model=hf", "rollout.engine=vllm", "device=cpu"]
    with pytest.raises(
        ConfigError, match=r"model.path=.*d16 \(head_dim=16\): vLLM's CPU build refuses head_dim=16"
    ):
        preflight(load_config([*hf, f"model.path={tmp_path / 'd16'}"]))
    preflight(load_config([*hf, f"model.path={tmp_path / 'd32'}"]))  # 32 is a size it runs
    preflight(load_config(["model=hf", f"model.path={tmp_path / 'd16'}"]))  # the torch engine runs any


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["eval.benchmarks=[{name: mine, path: x.jsonl, anwser_field: a}]"],
            "unknown config key 'eval.benchmarks[0].anwser_field' (did you mean "
            "'eval.benchmarks[0].answer_field'?)",
        ),
        (["eval.benchmarks=[arith_heldout,5]"], "eval.benchmarks[1]=5: give a benchmark name or a file spec"),
        (
            ["reward.components=[{target: 'pkg.mod:fn', ngram: 3}]"],
            "reward.components[0] (pkg.mod:fn) sets ['ngram'] beside params",
        ),
        (["rl.loss_params={scale: 2}"], "rl.loss_params is set but rl.loss names no loss"),
        (["rl.dual_clip=1"], "rl.dual_clip=1.0 must be > 1; verl uses 3.0; null turns it off"),
        (["data.levels=[99999999999]"], "data.levels[0]=99999999999 is out of range"),
    ],
)
def test_errors_name_the_full_key_the_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_simulate_errors_name_the_key_with_a_guess():
    from conf.simulate import load_simulate_config, simulate_config

    with pytest.raises(ConfigError, match=r"'workload.stepz' \(did you mean 'workload.steps'\?\)"):
        load_simulate_config(["workload.stepz=3"])
    with pytest.raises(ConfigError, match=r"workload.tools\[0\].latency.kind=fixed needs one value"):
        simulate_config({"workload": {"tools": [{"latency": {"kind": "fixed"}}]}})
    with pytest.raises(ConfigError, match=r"sched.admit_lag=0 must be >= 1"):
        simulate_config({"sched": {"admit_lag": 0}})
