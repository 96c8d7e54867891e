"""Several environments in one RL run, weighted (``envs=[{target: calculator, weight: 0.7}, ...]``).

Each item of ``envs`` (``conf.schema.EnvMixConfig``) is an environment with a weight and a prompt
pool. The manager's prompt source becomes a :class:`MixedSource`: one source per environment (the
seeded cursor over its pool, or HIVE's online source in front of it, each with its own GRESO history)
whose prompt ids carry the environment's name (``NAME/ID``, ``environments.mixed.tag``), and a
deterministic weighted interleave that hands environment ``i`` the prompt whenever it is furthest
below its share (``weight_i * drawn - taken_i`` largest, ties to the earlier item): after any number
of prompts each environment's count is within one of its share. The rollouts run one
``environments.mixed.MixedEnvironment`` (:func:`mixed_env`), which routes every episode to its own
environment. Metrics per environment (``env/NAME/...``) come with every step, HIVE's counters per
environment too; :func:`trained_shares` gives each environment's share of the trained groups.

prime-rl's per-environment ``ratio``, ROLL's ``domain_interleave_probs`` and PipelineRL's domain
sampling draw at random; the interleave here is exact, so a 0.7/0.3 mix is 0.7/0.3 at every step.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from conf.schema import EnvConfig, EnvMixConfig
from environments.mixed import split_tag, tag
from generation.records import PromptItem, ScoredGroup

MIXED_TARGET = "environments.mixed:MixedEnvironment"


def env_names(envs: Sequence[EnvMixConfig]) -> list[str]:
    """Each item's name (its ``name``, else its target), checked: distinct, no ``/``."""
    names = [e.name or e.target for e in envs]
    for n in names:
        if not n or "/" in n or ":" in n:
            raise ValueError(
                f"envs: the name {n!r} cannot tag prompt ids; give that item a name without / or :"
            )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"envs: two items are named {dup[0]!r}; give each a distinct name (envs[i].name)")
    return names


def mixed_env(envs: Sequence[EnvMixConfig]) -> EnvConfig:
    """The one ``env`` the rollouts run: ``MixedEnvironment`` over ``envs``, with the widest episode
    limits of them (each item's own ``max_turns`` still ends its episodes)."""
    names = env_names(envs)
    own = {
        n: EnvConfig.model_validate({k: getattr(e, k) for k in EnvConfig.model_fields})
        for n, e in zip(names, envs)
    }
    cfgs = list(own.values())
    return cfgs[0].model_copy(
        update=dict(
            target=MIXED_TARGET,
            params={"envs": own},
            max_turns=max(c.max_turns for c in cfgs),
            max_tokens=0 if any(c.max_tokens == 0 for c in cfgs) else max(c.max_tokens for c in cfgs),
            tool_timeout_s=max(c.tool_timeout_s for c in cfgs),
            tool_workers=max(c.tool_workers for c in cfgs),
        )
    )


def mix_key(envs: Sequence[EnvMixConfig]) -> dict:
    """The RL stage's cache key part for ``envs``: every item, a pool with its file's sha256; absent
    when ``envs`` is empty (keys unchanged)."""
    import hashlib

    if not envs:
        return {}
    items = []
    for e in envs:
        item = e.model_dump()
        if e.pool and Path(e.pool).is_file():
            item["pool_sha256"] = hashlib.sha256(Path(e.pool).read_bytes()).hexdigest()
        items.append(item)
    return {"envs": items}


def read_pool(path: str, tokenizer, template: str) -> list[PromptItem]:
    """An item's own prompt pool: a parquet file of prompt rows (prompt_id, problem, answer, level)."""
    from generation.model import encode_problem
    from generation.setup import read_table

    if not Path(path).is_file():
        raise ValueError(
            f"envs: pool {path!r} is not a file; give a parquet file of prompt rows or leave pool empty"
        )
    rows = read_table(Path(path))
    missing = {"prompt_id", "problem", "answer"} - set(rows[0] if rows else {})
    if not rows or missing:
        raise ValueError(f"envs: pool {path!r} has no rows or lacks the columns {sorted(missing)}")
    return [
        PromptItem(
            r["prompt_id"],
            r["problem"],
            str(r["answer"]),
            encode_problem(tokenizer, template, r["problem"]),
            r.get("level"),
        )
        for r in rows
    ]


def rl_sources(select, history_path, seed: int, env, envs, tokenizer, template: str) -> dict:
    """The RL drivers' ``source`` (a factory, or None: the cursor) and ``env``: ``curation.select``'s
    source (``training.rl.stage.hive_source``) and ``env`` alone, or with ``envs`` the weighted mix."""
    from training.rl.stage import hive_source

    def base():
        return hive_source(select, history_path, seed) if select is not None else None

    if not envs:
        return {"source": base(), "env": env}
    source, mixed = mixed_run(envs, base, tokenizer, template, seed)
    return {"source": source, "env": mixed}


def mixed_run(
    envs: Sequence[EnvMixConfig],
    base_source: Callable[[], Callable | None],
    tokenizer,
    template: str,
    seed: int,
):
    """``(source factory, env)`` for the RL drivers: the factory builds a :class:`MixedSource` from the
    driver's cursor (its prompts: the pool of items without their own) and policy copy, each item's
    source from ``base_source()`` (a fresh HIVE factory per item, or None: the cursor alone)."""
    from training.rl.loop import PromptCursor

    names = env_names(envs)
    pools = {n: read_pool(e.pool, tokenizer, template) for n, e in zip(names, envs) if e.pool}
    bases = {n: base_source() for n in names}

    def build(cursor, engine) -> MixedSource:
        subs = []
        for n, e in zip(names, envs):
            items = [
                dataclasses.replace(p, prompt_id=tag(n, p.prompt_id)) for p in pools.get(n, cursor.prompts)
            ]
            sub = PromptCursor(items, seed)
            subs.append((n, e.weight, bases[n](sub, engine) if bases[n] is not None else sub))
        return MixedSource(subs)

    return build, mixed_env(envs)


class MixedSource:
    """The weighted interleave of one prompt source per environment (module docstring). A prompt
    source to the manager: ``take``, ``observe``, ``round_size``, ``state``, ``step_counts``."""

    def __init__(self, subs: Sequence[tuple[str, float, object]]):
        if not subs or any(w <= 0 for _, w, _ in subs):
            raise ValueError("MixedSource needs at least one environment, each with a weight > 0")
        self.names = [n for n, _, _ in subs]
        total = sum(w for _, w, _ in subs)
        self.shares = {n: w / total for n, w, _ in subs}
        self.sources = {n: s for n, _, s in subs}
        self.taken: Counter = Counter()
        """Prompts drawn per environment so far (the interleave's state)."""
        self._window: dict[str, Counter] = {n: Counter() for n in self.names}

    @property
    def position(self) -> int:
        return sum(s.position for s in self.sources.values())

    def plan(self, n: int) -> list[str]:
        """The environments of the next ``n`` prompts, in order (advances the interleave)."""
        out = []
        for _ in range(n):
            drawn = sum(self.taken.values()) + 1
            name = max(
                self.names, key=lambda k: (self.shares[k] * drawn - self.taken[k], -self.names.index(k))
            )
            self.taken[name] += 1
            out.append(name)
        return out

    def take(self, n: int) -> list[PromptItem]:
        order = self.plan(n)
        drawn = {k: iter(self.sources[k].take(order.count(k))) for k in self.names if k in order}
        return [p for p in (next(drawn[k], None) for k in order) if p is not None]

    def observe(self, groups: Sequence[ScoredGroup]) -> None:
        by_env: dict[str, list[ScoredGroup]] = {}
        for g in groups:
            by_env.setdefault(split_tag(g.prompt_id)[0], []).append(g)
        for name, gs in by_env.items():
            self.sources[name].observe(gs)
            w = self._window[name]
            w["groups"] += len(gs)
            w["responses"] += sum(len(g.correct) for g in gs)
            w["correct"] += sum(sum(g.correct) for g in gs)
            w["reward"] += sum(sum(g.rewards) for g in gs)
            w["tool_calls"] += sum(t.tool_calls for g in gs for t in g.trajectories)
            w["turns"] += sum(t.turns for g in gs for t in g.trajectories)

    def round_size(self, remaining: int, zero_var_ratio: float, batch: int) -> int:
        return self.sources[self.names[0]].round_size(remaining, zero_var_ratio, batch)

    def step_counts(self) -> dict[str, float]:
        """Per environment since the last call: its completed groups and their share of all, accuracy,
        mean reward, tool calls and turns per episode (``env/NAME/...``), and its source's own
        counters (HIVE's drawn, skipped and pruned prompts)."""
        out: dict[str, float] = {}
        total = sum(w["groups"] for w in self._window.values())
        for name in self.names:
            w, n = self._window[name], max(1, self._window[name]["responses"])
            out[f"env/{name}/groups"] = float(w["groups"])
            out[f"env/{name}/group_share"] = w["groups"] / total if total else 0.0
            for key, num in (
                ("accuracy", "correct"),
                ("reward", "reward"),
                ("tool_calls", "tool_calls"),
                ("turns", "turns"),
            ):
                out[f"env/{name}/{key}"] = w[num] / n
            out.update({f"env/{name}/{k}": v for k, v in self.sources[name].step_counts().items()})
            w.clear()
        return out

    def state(self) -> dict:
        return {"taken": dict(self.taken), "sources": {n: s.state() for n, s in self.sources.items()}}

    def load_state(self, state: dict) -> None:
        self.taken = Counter(state["taken"])
        for n, s in self.sources.items():
            s.load_state(state["sources"][n])


def trained_shares(consumed: dict[str, int]) -> dict[str, float]:
    """Each environment's share of the trained responses (``RLResult.consumed``: tagged prompt id ->
    responses trained on); with one group size for all, its share of the trained groups."""
    per: Counter = Counter()
    for pid, k in consumed.items():
        per[split_tag(pid)[0]] += k
    total = sum(per.values())
    return {n: c / total for n, c in sorted(per.items())} if total else {}
