"""Environments with per-episode state: the interface's contract (plain data, one-line errors naming the
environment, the old ``step(turn_text)`` refused), an environment named by import path, and the state
travelling with its episode as the tokens do: a hand-over between engines mid-episode (repack), the
checkpoint codec, and a run through the real manager and local driver killed and resumed from its
checkpoint. Each finished episode's state is checked against a replay of the environment's steps
over the episode's own turns."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conf.schema import EngineOptions, EnvConfig, RLConfig
from core.plugins import PluginError
from environments.base import InterfaceError, StateError, StepResult, Turn, plain_state
from environments.episodes import EpisodeEngine, EpisodeLimits
from environments.guess import Guess
from environments.registry import make_environment
from generation.engine import Engine
from generation.model import build_char_tokenizer, load_model, load_tokenizer
from generation.records import GenRequest
from tests.environments.episode_helpers import (
    EvenLength,
    Killed,
    calc_prompts,
    killer,
    sigkill_trainer_at,
    spy_groups,
)
from training.rl.checkpoint import latest_checkpoint
from training.rl.control import ExperienceBuffer, trajectory_from_json, trajectory_to_json
from training.rl.drivers.local import LocalDriver
from training.rl.stage import objective_params
from training.rl.sections import RLSections

GUESS = EnvConfig(target="guess", max_turns=4)
ROOT = Path(__file__).resolve().parents[2]


def replay(env, tok, t):
    """The state and observations the environment's own steps give over trajectory ``t``'s policy
    turns (the runs of ones in its loss mask; a last turn cut by the length cap, a timeout or a crash
    was never answered), from ``reset`` of its prompt."""
    _, state = env.reset(t.prompt)
    runs, start = [], 0
    mask = t.loss_mask
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], t.response_tokens[start:i]))
            start = i
    turns = [toks for m, toks in runs if m == 1]
    observations = [toks for m, toks in runs if m == 0]
    seen = []
    stepped = t.turns - (t.end_reason in ("length", "tool_timeout", "env_error"))  # the last never answered
    for toks in turns[:stepped]:
        body = list(toks[:-1]) if toks and toks[-1] == tok.eos_token_id else list(toks)
        res = env.step(state, Turn(tok.decode(body, skip_special_tokens=True), tuple(toks)))
        if res.observation:
            seen.append(tuple(res.observation))
        state = res.state
    return state, seen, observations


def assert_replays(env, tok, trajectories):
    """Every episode's carried state is exactly what the environment's steps over its turns give."""
    assert trajectories
    for t in trajectories:
        state, seen, observations = replay(env, tok, t)
        assert t.env_state == state, (t.env_state, state)
        assert seen[: len(observations)] == [tuple(o) for o in observations]


# --------------------------------------------------------------------------------- the contract
def test_plain_state_refuses_what_json_cannot_hold_in_one_line_naming_the_environment():
    assert plain_state("g", {"a": (1, 2), "b": [None, True, 1.5, "x"]}) == {
        "a": [1, 2],
        "b": [None, True, 1.5, "x"],
    }
    for bad, words in [
        ({"s": {1, 2}}, "state['s'] is a set"),
        ({1: "x"}, "has the key 1 (int)"),
        ({"f": float("nan")}, "state['f'] is nan"),
        ([object()], "state[0] is a object"),
    ]:
        with pytest.raises(StateError) as e:
            plain_state("wordle", bad)
        assert "environment 'wordle'" in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


class Counter_:
    """Counts its episode's turns in its state; ``bad`` puts a set in it at the second turn."""

    name = "counter"

    def __init__(self, tok, bad=False, mutate=False):
        self.obs = tuple(tok("\n= ok\n", add_special_tokens=False)["input_ids"])
        self.bad, self.mutate = bad, mutate

    def reset(self, prompt):
        return prompt.prompt_tokens, {"n": 0, "texts": []}

    def step(self, state, turn):
        n = state["n"] + 1
        new = {"n": n, "texts": list(state["texts"]) + [turn.text], "tokens": list(turn.tokens)}
        if self.mutate:
            state["texts"].append("mutated in place")  # the episode's stored state must not see this
            new["texts"].append("mutated in place")  # nor its next state
            new["texts"].pop()
        if self.bad and n == 2:
            new["seen"] = {1}
        return StepResult(self.obs, tool_call=True, state=new)

    def close(self):
        pass


def _requests(tok, n=4):
    return [GenRequest(p, sample_idx=i % 2, group_uid=i) for i, p in enumerate(calc_prompts(tok, n))]


def _runner(model, tok, env, turns=3, capacity=4):
    engine = Engine(model, tok, EngineOptions(max_new_tokens=24, capacity=capacity, seed=3))
    return EpisodeEngine(engine, env, tok, EpisodeLimits(max_turns=turns))


def test_a_state_that_is_not_plain_data_stops_the_run_with_one_line(guesser_dir):
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    with pytest.raises(StateError, match=r"environment 'counter': state\['seen'\] is a set"):
        _runner(model, tok, Counter_(tok, bad=True)).generate(_requests(tok))


def test_each_step_gets_a_copy_of_the_state_and_the_turn_with_its_tokens(guesser_dir):
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    trajs = _runner(model, tok, Counter_(tok, mutate=True)).generate(_requests(tok))
    full = [t for t in trajs if t.end_reason == "max_turns"]
    assert full
    for t in full:
        assert t.env_state["n"] == t.turns == 3 and len(t.env_state["texts"]) == 3
        assert not any("mutated" in x for x in t.env_state["texts"])
        assert t.env_state["tokens"][-1] == tok.eos_token_id
    assert_replays(Counter_(tok), tok, trajs)  # the texts and the last turn's tokens, turn by turn
    assert all(t.env_state["n"] == t.turns - 1 for t in trajs if t.end_reason == "length")


def test_an_old_style_environment_is_refused_with_the_migration_named(guesser_dir):
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)

    class Old:
        name = "old"

        def reset(self, prompt):
            return prompt.prompt_tokens

        def step(self, state, turn):
            return StepResult(done=True)

        def close(self):
            pass

    with pytest.raises(
        InterfaceError, match=r"environment 'old': reset\(prompt\) must return \(tokens, state\)"
    ):
        _runner(model, tok, Old()).generate(_requests(tok, 1))


# ------------------------------------------------------------------------ by import path
@pytest.fixture
def plugin_pkg(tmp_path, monkeypatch):
    """A user's package outside the repository: a stateful environment with its own Params, and one
    written for the old ``step(turn_text)``."""
    root = tmp_path / "plug_envs_stateful"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "games.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel, Field

            from environments.base import StepResult


            class Tally:
                name = "tally"

                class Params(BaseModel):
                    limit: int = Field(3, ge=1)

                def __init__(self, tokenizer, params, env):
                    self.tokenizer, self.limit = tokenizer, params.limit

                def reset(self, prompt):
                    return prompt.prompt_tokens, {"seen": []}

                def step(self, state, turn):
                    seen = state["seen"] + [len(turn.tokens)]
                    if len(seen) >= self.limit:
                        return StepResult(done=True, reason="answer", state={"seen": seen})
                    ids = self.tokenizer(f"= {sum(seen)}", add_special_tokens=False)["input_ids"]
                    return StepResult(tuple(ids), tool_call=True, state={"seen": seen})

                def close(self):
                    pass


            class Old:
                def __init__(self, tokenizer, params, env):
                    pass

                def reset(self, prompt):
                    return prompt.prompt_tokens

                def step(self, turn_text):
                    return StepResult(done=True)

                def close(self):
                    pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "plug_envs_stateful.games"
    for name in [m for m in sys.modules if m.startswith("plug_envs_stateful")]:
        del sys.modules[name]


def test_an_environment_by_import_path_runs_with_its_params_and_state(plugin_pkg, guesser_dir):
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    cfg = EnvConfig(target=f"{plugin_pkg}:Tally", params={"limit": 2}, max_turns=4)
    env = make_environment(cfg, tok)
    assert env.limit == 2
    trajs = _runner(model, tok, env, turns=4).generate(_requests(tok))
    assert all(t.turns == 2 and t.end_reason == "answer" and len(t.env_state["seen"]) == 2 for t in trajs)
    assert_replays(env, tok, trajs)


@pytest.mark.parametrize(
    ("target", "params", "words"),
    [
        ("Tally", {"limit": 0}, "params.limit: Input should be greater than or equal to 1"),
        ("Tally", {"limt": 2}, "unknown params ['limt']"),
        ("Old", {}, "step(turn_text) does not take step(state, turn) (the old step(turn_text)"),
        ("Nope", {}, "has no attribute 'Nope'"),
    ],
)
def test_a_bad_environment_target_is_one_line_naming_it(plugin_pkg, target, params, words):
    from conf.schema import Config, ConfigError
    from tasks.preflight import _check_environment

    cfg = Config(env=EnvConfig(target=f"{plugin_pkg}:{target}", params=params, max_turns=3))
    with pytest.raises(ConfigError) as e:
        _check_environment(cfg)
    assert words in str(e.value) and f"{plugin_pkg}:{target}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PluginError):
        make_environment(cfg.env, build_char_tokenizer())


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("Old", "step(turn_text) does not take step(state, turn)"),
        ("Nope", "has no attribute 'Nope'"),
    ],
)
def test_each_mixed_environment_target_is_checked_in_one_line_naming_its_item(plugin_pkg, target, words):
    """``envs[i].target`` gets the same check as ``env.target`` (imports, right signature), and the
    line names the item; the valid items around it pass."""
    from conf.schema import Config, ConfigError, EnvMixConfig
    from tasks.preflight import _check_environment

    good = EnvMixConfig(target=f"{plugin_pkg}:Tally", max_turns=3, name="tally")
    _check_environment(Config(envs=[good, EnvMixConfig(target="calculator", max_turns=3)]))
    bad = EnvMixConfig(target=f"{plugin_pkg}:{target}", max_turns=3, name="bad")
    with pytest.raises(ConfigError) as e:
        _check_environment(Config(envs=[good, bad]))
    line = str(e.value)
    assert line.startswith("envs[1].target: ") and f"'{plugin_pkg}:{target}'" in line and words in line
    assert "\n" not in line


def _laminar_run(ws, *overrides):
    """``laminar run --workspace ws OVERRIDES`` in a subprocess (this checkout on its path)."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--workspace", str(ws), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_cli_refuses_an_unimportable_mixed_environment_before_any_write(tmp_path):
    ws = tmp_path / "ws"
    mix = "envs=[{target: calculator, max_turns: 3}, {target: 'no_such_pkg_q.envs:Game', max_turns: 3}]"
    proc = _laminar_run(ws, mix)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("laminar: config error: envs[1].target: plug-in 'no_such_pkg_q.envs:Game' ")
    assert "cannot be imported: ModuleNotFoundError" in line and not ws.exists()


def test_the_cli_refuses_an_unimportable_environment_before_any_write(tmp_path):
    ws = tmp_path / "ws"
    proc = _laminar_run(ws, "env.target=no_such_pkg_q.envs:Game", "env.max_turns=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("laminar: config error: env.target: plug-in 'no_such_pkg_q.envs:Game' ")
    assert "cannot be imported: ModuleNotFoundError" in line and not ws.exists()


def _doc_example() -> str:
    """The stateful environment docs/environments.md prints (the python block of my_envs/countdown.py)."""
    text = (ROOT / "docs" / "environments.md").read_text()
    block = text.split("```python\n# my_envs/countdown.py\n", 1)[1].split("```", 1)[0]
    return block


def test_the_docs_example_environment_runs_by_import_path_with_its_state(tmp_path, monkeypatch, guesser_dir):
    """The docs' example, written into a package outside the repository, passes the preflight with the
    docs' own command line and runs episodes whose state is what its steps give."""
    from tasks.preflight import load_checked

    pkg = tmp_path / "my_envs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "countdown.py").write_text(_doc_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        docs = (ROOT / "docs" / "environments.md").read_text()
        line = next(x for x in docs.splitlines() if x.startswith("laminar run env.target=my_envs.countdown"))
        cfg = load_checked(line.split()[2:]).env
        assert cfg.target == "my_envs.countdown:Countdown" and cfg.params == {"tries": 4}
        model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
        env = make_environment(EnvConfig(target=cfg.target, params={"tries": 3}, max_turns=5), tok)
        trajs = _runner(model, tok, env, turns=5).generate(_requests(tok))
        assert all(t.env_state["answer"] == t.prompt.answer for t in trajs)
        assert all("no, 2 left" in t.text and t.turns >= 2 for t in trajs)  # the first try was wrong
        assert all(len(t.env_state["tries"]) == t.turns - (t.end_reason == "length") for t in trajs)
        assert_replays(env, tok, trajs)
    finally:
        for name in [m for m in sys.modules if m.startswith("my_envs")]:
            del sys.modules[name]


def test_an_unknown_short_name_suggests_the_closest():
    with pytest.raises(PluginError, match=r"unknown environments 'gues' \(did you mean 'guess'\?\)"):
        make_environment(EnvConfig(target="gues", max_turns=3), build_char_tokenizer())


# ------------------------------------------------------------------------ the state travels
def test_a_guess_episode_handed_over_mid_episode_keeps_its_state(guesser_dir):
    """Repack's mechanism: episodes extracted from one engine mid-episode (some decoding a turn, some
    waiting on their step with the unanswered turn) and injected into another finish with the state
    the game's steps give over their turns, the same episodes as a run without the hand-over."""
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    env = Guess(tok)
    reqs = _requests(tok, 6)
    whole = _runner(model, tok, env, turns=4, capacity=6).generate(reqs)
    a, b = _runner(model, tok, env, turns=4, capacity=6), _runner(model, tok, env, turns=4, capacity=6)
    a.version = b.version = 0
    a.submit(reqs)
    done = []
    for _ in range(40):
        done += a.step(3)
        if any(ep.turns >= 1 for ep in a._episodes.values()):
            break
    partials, queued = a.extract()
    moved = [p.request.episode for p in partials if p.request.episode is not None]
    assert any(ep.turns >= 1 and ep.state["guesses"] for ep in moved), moved
    b.submit(queued)
    b.inject(partials)
    while b.status()["active"] or b.status()["queued"]:
        done += b.step(12)
    assert len(done) == 6 and all(t.turns > 1 and t.env_state["guesses"] for t in done)
    assert_replays(env, tok, done)
    assert any("again 2" in t.text for t in done)  # the feedback that needs the earlier guesses
    key = lambda t: (t.group_uid, t.sample_idx)  # noqa: E731 - a sort key
    assert [(t.response_tokens, t.env_state) for t in sorted(done, key=key)] == [
        (t.response_tokens, t.env_state) for t in sorted(whole, key=key)
    ]


def test_a_repack_through_the_rollout_manager_moves_guess_episodes_with_their_state(guesser_dir):
    """The manager's repack path (laminar mode: plan, extract order, hand-over, inject order) with real
    episode engines: the episodes rollout-1 holds mid-game (several turns in, their guesses in their
    state) reach rollout-0 through ``extract_done`` and ``dispatch`` and finish there with exactly
    the state the game's steps give over their turns."""
    from tests.training.test_manager import Outside
    from training.rl.control import MODES
    from training.rl.loop import PromptCursor
    from training.rl.manager import ManagerSettings, RolloutManager
    from training.rl.records import ExtractOrder, PullResult, RolloutStatus

    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    env = Guess(tok)
    settings = ManagerSettings(
        mode=MODES["laminar"], steps=3, prompts_per_step=2, group_size=2, capacity=4, max_staleness=None
    )
    rollouts = [(f"rollout-{i}", "node", "relay-0") for i in range(2)]
    m = RolloutManager(settings, PromptCursor(calc_prompts(tok, 8), 0), lambda ts: None, Outside(), rollouts)
    src, dst = _runner(model, tok, env, turns=4), _runner(model, tok, env, turns=4)
    src.version = dst.version = 0
    order = m.dispatch("rollout-1")
    src.submit(list(order.submit))
    finished = []
    while not any(ep.turns >= 2 for ep in src._episodes.values()):
        finished += src.step(3)
    assert not finished  # every episode still in flight, some two turns in
    # rollout-1 in its long tail (active falling), rollout-0 idle at the same version: repack
    m.step_done("rollout-1", [], RolloutStatus(0, 3, 0, 4), PullResult(True, 0))
    m.rollouts["rollout-1"].busy = True
    m.step_done("rollout-1", [], RolloutStatus(0, 1, 0, 4), None)
    m.dispatch("rollout-0")
    m.step_done("rollout-0", [], RolloutStatus(0, 0, 0, 4), PullResult(True, 0))
    m.repack()
    assert isinstance(m.dispatch("rollout-1"), ExtractOrder)
    partials, queued = src.extract()
    moved = {(p.request.group_uid, p.request.sample_idx): p.request.episode.state for p in partials}
    assert any(len(s["guesses"]) >= 2 for s in moved.values()), moved
    assert m.extract_done("rollout-1", partials, queued, RolloutStatus(0, 0, 0, 4)) == "rollout-0"
    order = m.dispatch("rollout-0")
    got = {(p.request.group_uid, p.request.sample_idx): p.request.episode.state for p in order.inject}
    assert got == moved  # the manager hands the episodes over as they left, state and all
    dst.admitting = order.admitting
    dst.submit(list(order.submit))
    dst.inject(list(order.inject))
    done = []
    while dst.status()["active"] or dst.status()["queued"]:
        done += dst.step(12)
    mine = [t for t in done if (t.group_uid, t.sample_idx) in moved]
    assert len(mine) == len(moved) and all(len(t.env_state["guesses"]) >= 2 for t in mine)
    assert_replays(env, tok, mine)
    for t in mine:  # a moved episode keeps the guesses it had made before the hand-over
        before = moved[(t.group_uid, t.sample_idx)]["guesses"]
        assert t.env_state["guesses"][: len(before)] == before


def test_a_finished_episodes_state_survives_the_checkpoint_codec_and_buffer(guesser_dir):
    model, tok = load_model(guesser_dir)[0], load_tokenizer(guesser_dir)
    trajs = _runner(model, tok, Guess(tok), turns=4).generate(_requests(tok, 4))
    t = trajs[0]
    assert t.env_state["guesses"]
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))))
    assert back == t and back.env_state == t.env_state
    buf = ExperienceBuffer(2, lambda ts: None)  # one of a group of two: held, as in a checkpoint
    buf.add(t)
    other = ExperienceBuffer(2, lambda ts: None)
    other.load_state(json.loads(json.dumps(buf.state())))
    assert other.partial[t.group_uid][t.sample_idx] == t


def test_a_guess_run_through_the_manager_resumes_with_its_episodes_states(monkeypatch, tmp_path, guesser_dir):
    """The local driver (the real rollout manager, sync) on ``guess`` episodes, checkpointing every
    other update, killed after update 3 and resumed from update 2: every trained episode, before and
    after the resume, carries exactly the state the game's steps give over its turns, and the resumed
    run ends as the unkilled one with the same episodes' states."""
    tok = load_tokenizer(guesser_dir)
    rl = RLConfig(
        mode="sync", runtime="local", steps=4, prompts_per_step=2, group_size=2, lr=1e-3,
        max_new_tokens=12, rollout_capacity=8, chunk_steps=4, micro_batch_tokens=0, checkpoint_every=2,
    )  # fmt: skip
    trained = spy_groups(monkeypatch)
    ran = []

    def run(folder, kill_at=None):
        trained.clear()
        driver = LocalDriver(
            guesser_dir, calc_prompts(tok, 8), EvenLength(), objective_params(rl),
            RLSections(rl, seed=0, env=GUESS), device="cpu", state_dir=tmp_path / folder,
            on_step=killer(ran, folder, kill_at),
        )  # fmt: skip
        result = driver.run()
        return result, [t for _, g in trained for t in g.trajectories]

    whole, whole_trained = run("whole")
    with pytest.raises(Killed):
        run("killed", kill_at=3)
    killed_trained = [t for _, g in trained for t in g.trajectories]
    assert latest_checkpoint(tmp_path / "killed" / "checkpoints").name == "step-000002"
    ran.clear()
    resumed, resumed_trained = run("killed")
    assert ran == [("killed", 3), ("killed", 4)]  # it resumed: updates 1-2 came from the checkpoint
    assert len(whole.history) == len(resumed.history) == 4
    env = Guess(tok)
    killed = killed_trained + resumed_trained
    for got in (whole_trained, killed):
        assert_replays(env, tok, got)
        assert all(t.env_state is not None and t.turns > 1 for t in got)
    key = lambda t: (t.group_uid, t.sample_idx)  # noqa: E731 - a sort key
    assert {key(t): t.env_state for t in killed} == {key(t): t.env_state for t in whole_trained}


@pytest.mark.slow
def test_a_laminar_guess_run_resumes_with_its_episodes_states(monkeypatch, tmp_path, local_ray, guesser_dir):
    """The Ray runtime in laminar mode (two rollouts) on ``guess`` episodes, the trainer SIGKILLed
    after update 5: the update-4 checkpoint holds finished episodes with their states; the resumed run
    trains them as saved (state included) and every episode trained by either run carries exactly the
    state the game's steps give over its turns. (This short run rarely repacks: the manager's repack
    path is the in-process test above.)"""
    from conf.schema import ClusterConfig
    from tests.training.rl_fakes import ray_rl
    from training.rl.checkpoint import RUN_STATE, load_json
    from training.rl.drivers.ray import LaminarRuntime

    ray = local_ray
    tok = load_tokenizer(guesser_dir)
    rl = ray_rl(
        "laminar", steps=8, lr=1e-3, checkpoint_every=2, eval_every=0, group_size=4, rollout_capacity=16,
        max_new_tokens=16,
    )  # fmt: skip
    batches = spy_groups(monkeypatch)

    def runtime(on_step=None):
        run = RLSections(rl, seed=0, cluster=ClusterConfig(rollouts=2, actor_threads=1), env=GUESS)
        return LaminarRuntime(
            guesser_dir, calc_prompts(tok, 200), EvenLength(), objective_params(rl), run, device="cpu",
            state_dir=tmp_path / "state", on_step=on_step,
        )  # fmt: skip

    rt = runtime(sigkill_trainer_at(5, ray, lambda: rt))
    with pytest.raises(ray.exceptions.RayActorError):
        rt.run()
    first = [t for _, g in batches for t in g.trajectories]
    last = latest_checkpoint(tmp_path / "state" / "checkpoints")
    assert last is not None and last.name == "step-000004"
    saved = load_json(last, RUN_STATE)
    held = [trajectory_from_json(t) for t in saved["buffer"]["partial"] + saved["buffer"]["ready"]]
    assert held and all(t.env_state is not None for t in held)
    assert any(t.turns > 1 and len(t.env_state["guesses"]) > 1 for t in held)
    batches.clear()
    rt2 = runtime()
    rt2.run()
    assert rt2.summary.get("resumed") == 1
    second = [t for _, g in batches for t in g.trajectories]
    env = Guess(tok)
    assert_replays(env, tok, held)
    assert_replays(env, tok, first + second)
    assert all(t.turns > 1 and t.env_state["guesses"] for t in first + second if t.end_reason == "max_turns")
    trained = {(t.group_uid, t.sample_idx): t for t in second}
    kept = [t for t in held if trained.get((t.group_uid, t.sample_idx)) == t]  # trained as saved
    assert kept, (len(held), len(trained))
