"""Multi-turn episodes on the engine: training tokens are the tokens the engine consumed (a real BPE
tokenizer and chat template; re-rendering from text is caught), observation tokens carry no loss,
hung and crashing environments end episodes with a reason, and an in-flight episode moves between
engines with its state."""

import random
import threading
import time

import pytest
import torch

from conf.schema import EngineOptions, EnvConfig, ToolLatencyConfig
from environments.base import StepResult
from environments.calculator import Calculator
from environments.episodes import EpisodeEngine, EpisodeLimits
from environments.latency import LatencySampler
from environments.registry import wrap_engine
from environments.tool_use import ChatTemplateFormat
from generation.engine import Engine
from generation.records import GenRequest, PromptItem, ScoredGroup
from generation.sampler import request_key
from tests.environments.bpe import bpe_tokenizer, random_qwen2
from training.objectives import ObjectiveParams
from training.rl.trainer import PolicyTrainer, build_batch, response_logits, token_logprobs

RESULT = "16"


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return random_qwen2(tok)


class AlwaysCalls:
    """Every turn is answered with the tool result ``RESULT`` in the chat template's tool message."""

    name = "always_calls"

    def __init__(self, tok, delay: float = 0.0):
        self.fmt = ChatTemplateFormat(tok, [Calculator()])
        self.delay = delay

    def reset(self, prompt):
        return self.fmt.reset(prompt), None

    def step(self, state, turn):
        time.sleep(self.delay)
        return StepResult(self.fmt.observation(RESULT, False), tool_call=True)

    def close(self):
        pass


class Recording(Engine):
    """The engine, recording the context (prompt tokens) of every row it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.contexts: dict[tuple, tuple[int, ...]] = {}
        self.sampled: dict[tuple, tuple[int, ...]] = {}

    def step(self, max_steps):
        out = super().step(max_steps)
        for t in out:
            self.sampled[(t.prompt.prompt_id, t.group_uid, t.sample_idx)] = t.response_tokens
        return out

    def submit(self, requests, sampling=None):
        for r in requests:
            self.contexts[request_key(r)] = r.prompt.prompt_tokens
        super().submit(requests, sampling)

    def inject(self, partials):
        for p in partials:
            self.contexts[request_key(p.request)] = p.request.prompt.prompt_tokens
        super().inject(partials)


def _requests(n=6):
    texts = ["What is 12 + 7 - 3?", "What is 4 * 5?", "Compute 9 - 2 + 1."]
    return [
        GenRequest(PromptItem(f"q{i}", texts[i % 3], "16", (0,)), sample_idx=i % 2, group_uid=i)
        for i in range(n)
    ]


def _episodes(tok, model, env, engine_cls=Engine, turns=3, **limits):
    engine = engine_cls(model, tok, EngineOptions(max_new_tokens=24, capacity=4, seed=3))
    runner = EpisodeEngine(engine, env, tok, EpisodeLimits(max_turns=turns, **limits))
    return runner, runner.generate(_requests())


def _runs(mask):
    """(start, end) of each run of equal values in ``mask``."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def _training_row(t, tok):
    batch = build_batch([ScoredGroup("scored_group", "g", (t,), (0.0,), (False,))], tok.pad_token_id)
    return tuple(batch.input_ids[0, : int(batch.attention_mask[0].sum())].tolist())


def _consumed_matches(row, t, engine):
    """The training row is, token for token, what the engine consumed and sampled: turn by turn,
    each turn's context followed by the tokens sampled in it, then the next turn's context starts
    with both (the observation after them), and the last turn's context plus its tokens is the row."""
    mine = (t.group_uid, t.sample_idx)
    keys = sorted(
        (k for k in engine.contexts if k[0].split("|")[0] == t.prompt.prompt_id and k[1:] == mine),
        key=lambda k: len(engine.contexts[k]),
    )
    if len(keys) != t.turns:
        return False
    seen = [engine.contexts[k] + engine.sampled[k] for k in keys]
    return (
        all(row[: len(s)] == s for s in seen)
        and row == seen[-1]
        and all(engine.contexts[b][: len(s)] == s for s, b in zip(seen, keys[1:]))
    )


def _rerendered(t, tok, fmt):
    """The negative control: the conversation re-rendered from its text through the chat template
    and tokenized again (what a text-level agent loop would train on)."""
    messages = [{"role": "user", "content": t.prompt.text}]
    for v, s, e in _runs(t.loss_mask):
        text = tok.decode(list(t.response_tokens[s:e]), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text} if v else {"role": "tool", "content": RESULT})
    ids = tok.apply_chat_template(messages, tools=fmt.schemas, tokenize=True)
    return tuple(ids["input_ids"] if hasattr(ids, "input_ids") or isinstance(ids, dict) else ids)


def test_three_turn_episode_trains_on_exactly_the_tokens_the_engine_consumed(tok, model):
    env = AlwaysCalls(tok)
    runner, trajs = _episodes(tok, model, env, engine_cls=Recording)
    three = [t for t in trajs if t.turns == 3 and t.end_reason == "max_turns"]
    assert len(three) >= 3, [(t.turns, t.end_reason) for t in trajs]
    obs = env.fmt.observation(RESULT, False)
    for t in three:
        assert len(t.response_tokens) == len(t.behaviour_logprobs) == len(t.loss_mask)
        assert t.tool_calls == 3 and t.prompt.prompt_tokens == env.reset(t.prompt)[0]
        observations = [t.response_tokens[s:e] for v, s, e in _runs(t.loss_mask) if v == 0]
        assert observations == [obs, obs]
        row = _training_row(t, tok)
        assert row == t.prompt.prompt_tokens + t.response_tokens
        assert _consumed_matches(row, t, runner.inner)
        # the negative control fails the same check: re-rendered text is not what the policy saw
        again = _rerendered(t, tok, env.fmt)
        assert again != row and not _consumed_matches(again, t, runner.inner)
    # the policy tokens' behaviour log-probs are the trainer's forward over the training row
    group = ScoredGroup("scored_group", "g", tuple(three), (0.0,) * len(three), (False,) * len(three))
    batch = build_batch([group], tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, batch, "cpu"), batch.targets, 1.0)
    policy = (batch.loss_mask * batch.mask).bool()
    assert torch.allclose(lp[policy], batch.behaviour[policy], atol=1e-4)
    assert not policy[batch.mask.bool()].all()  # observation tokens are in the row, masked out


def test_observation_tokens_get_no_gradient_from_loss_kl_or_entropy(tok, model):
    _, trajs = _episodes(tok, model, AlwaysCalls(tok), turns=3)
    trajs = [t for t in trajs if t.turns == 3][:2]
    group = ScoredGroup("scored_group", "g", tuple(trajs), (1.0, 0.0), (True, False))
    params = ObjectiveParams(kl_coef=0.1, entropy_coef=0.01)
    trainer = PolicyTrainer(
        random_qwen2(tok),
        params,
        lr=1e-3,
        weight_decay=0.0,
        max_grad_norm=1.0,
        temperature=1.0,
        max_new_tokens=24,
        pad_id=tok.pad_token_id,
        device="cpu",
    )
    trainer.pack = False
    grads = []
    plain = trainer._response_logits

    def hooked(model, sub):
        logits = plain(model, sub)
        if logits.requires_grad:  # the update's forward (the reference's runs without grad)
            logits.register_hook(lambda g: grads.append((sub, g.detach().clone())))
        return logits

    trainer._response_logits = hooked
    trainer.update([group])
    ((sub, g),) = grads
    per_token = g.abs().sum(-1)  # (B, T)
    obs = (sub.mask * (1 - sub.loss_mask)).bool()
    pol = (sub.mask * sub.loss_mask).bool()
    assert obs.any() and pol.any()
    assert float(per_token[obs].max()) == 0.0
    assert float(per_token[pol].min()) > 0.0


def test_a_hung_tool_ends_only_its_episode_with_a_recorded_reason(tok, model):
    class HangsOnce(AlwaysCalls):
        def __init__(self, tok):
            super().__init__(tok)
            self.lock, self.first = threading.Lock(), True

        def step(self, state, turn):
            with self.lock:
                hang, self.first = self.first, False
            if hang:
                time.sleep(1.5)
            return super().step(state, turn)

    _, trajs = _episodes(tok, model, HangsOnce(tok), tool_timeout_s=0.3)
    reasons = [t.end_reason for t in trajs]
    assert reasons.count("tool_timeout") == 1 and len(trajs) == 6
    hung = next(t for t in trajs if t.end_reason == "tool_timeout")
    assert not hung.finished and hung.tool_errors == 1


@pytest.mark.parametrize("on_error", ["fail", "retry"])
def test_an_environment_crash_fails_or_retries_the_episode_once(tok, model, on_error):
    class CrashesOnce(AlwaysCalls):
        def __init__(self, tok):
            super().__init__(tok)
            self.lock, self.first = threading.Lock(), True

        def step(self, state, turn):
            with self.lock:
                crash, self.first = self.first, False
            if crash:
                raise RuntimeError("environment bug")
            return super().step(state, turn)

    runner, trajs = _episodes(tok, model, CrashesOnce(tok), on_error=on_error)
    assert len(trajs) == 6 and all(t is not None for t in trajs)
    assert len({(t.prompt.prompt_id, t.group_uid, t.sample_idx) for t in trajs}) == 6  # none twice
    assert runner.env_errors == 1
    failed = [t for t in trajs if t.end_reason == "env_error"]
    assert len(failed) == (1 if on_error == "fail" else 0)


def test_an_in_flight_episode_moves_to_another_engine_with_its_state(tok, model):
    env = AlwaysCalls(tok, delay=0.02)
    _, whole = _episodes(tok, model, env)

    def runner():
        return EpisodeEngine(
            Engine(model, tok, EngineOptions(max_new_tokens=24, capacity=4, seed=3)),
            env,
            tok,
            EpisodeLimits(max_turns=3),
        )

    a, b = runner(), runner()
    a.version = b.version = 0
    a.submit(_requests())
    done = []
    for _ in range(4):
        done += a.step(5)
    partials, queued = a.extract()
    assert any(p.request.episode is not None and p.request.episode.turns >= 1 for p in partials)
    assert a.status()["active"] == 0
    b.submit(queued)
    b.inject(partials)
    while b.status()["active"] or b.status()["queued"]:
        done += b.step(24)
    key = lambda t: (t.prompt.prompt_id, t.group_uid)  # noqa: E731 - a sort key
    assert [(t.response_tokens, t.loss_mask) for t in sorted(done, key=key)] == [
        (t.response_tokens, t.loss_mask) for t in sorted(whole, key=key)
    ]


def test_single_turn_leaves_the_engine_as_it_is(tok, model):
    engine = Engine(model, tok, EngineOptions(max_new_tokens=8))
    assert wrap_engine(engine, EnvConfig()) is engine
    assert isinstance(wrap_engine(engine, EnvConfig(target="calculator", max_turns=3), tok), EpisodeEngine)


def test_an_episode_survives_the_checkpoint_codec(tok, model):
    import json

    from training.rl.control import trajectory_from_json, trajectory_to_json

    _, trajs = _episodes(tok, model, AlwaysCalls(tok))
    t = next(t for t in trajs if t.turns == 3)
    back = trajectory_from_json(json.loads(json.dumps(trajectory_to_json(t))))
    assert back == t and back.loss_mask == t.loss_mask and back.end_reason == "max_turns"


# ------------------------------------------------------------------------ tool latency
def _latency_runner(tok, model, latency, **limits):
    engine = Engine(model, tok, EngineOptions(max_new_tokens=24, capacity=6, seed=3))
    lim = EpisodeLimits(max_turns=2, latency=LatencySampler(latency), **limits)
    return EpisodeEngine(engine, AlwaysCalls(tok), tok, lim)


def test_episodes_wait_their_latency_without_holding_a_tool_thread(tok, model):
    runner = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[30.0]), tool_workers=1)
    runner.version = 0
    runner.submit(_requests())
    for _ in range(40):
        runner.step(24)
        now = time.monotonic()
        held = [w for w in runner._waiting if w.fut.done() and w.ready_at() > now]
        if len(held) >= 2:
            break
    # two or more answered calls wait their 30 s at once, with the one tool thread free
    assert len(held) >= 2 and all(w.delay == 30.0 for w in held)
    assert runner.status()["active"] >= len(held)
    runner.close()
    fast = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[0.3]))
    t0 = time.monotonic()
    trajs = fast.generate(_requests(2))
    assert any(t.tool_calls for t in trajs) and time.monotonic() - t0 >= 0.3


def test_a_latency_past_the_tool_timeout_ends_the_episode(tok, model):
    runner = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[5.0]), tool_timeout_s=0.3)
    reasons = [t.end_reason for t in runner.generate(_requests())]
    assert "tool_timeout" in reasons and set(reasons) <= {"tool_timeout", "length"}


def test_a_handed_over_episode_waits_only_the_latency_it_had_left(tok, model):
    a = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[30.0]))
    b = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[0.0]))
    a.version = b.version = 0
    a.submit(_requests(2))
    while not any(w.fut.done() for w in a._waiting):
        a.step(24)
    t0 = time.monotonic()
    partials, _ = a.extract()
    left = [p.request.episode.pending_delay_s for p in partials if p.request.episode.pending]
    assert left and all(30.0 - (t0 - w) - 1.0 <= x <= 30.0 for x, w in zip(left, [t0] * len(left)))
    b.inject(partials)
    assert sorted(w.delay for w in b._waiting) == sorted(left)  # not b's own draw (0 s)
    a.close()
    b.close()


def test_a_wake_cuts_a_wait_on_a_slow_tool_short(tok, model):
    """A step call with nothing to decode waits on its tools; a wake from another thread (the
    manager's news: a newer version, handed-over work) returns it at once, and a wake that came
    before the call does not cut the next call's wait."""
    runner = _latency_runner(tok, model, ToolLatencyConfig(kind="fixed", seconds=[30.0]))
    runner.version = 0
    runner.submit(_requests(2))
    while runner.inner.status()["active"] or runner.inner.status()["queued"]:
        runner.step(24)  # every first turn ends and waits on its 30 s tool
    assert runner._waiting
    while not all(w.fut.done() for w in runner._waiting):  # a step returning also ends a wait
        time.sleep(0.01)
    runner.wake()  # before the call: the order that started the call already knew
    timer = threading.Timer(0.3, runner.wake)
    timer.start()
    t0 = time.monotonic()
    assert runner.step(24) == []
    took = time.monotonic() - t0
    timer.join()
    assert 0.25 <= took < 5.0, took  # waited for the wake, not for the tool (30 s) nor not at all
    assert runner._waiting and runner.status()["active"] == 2  # nothing lost: both still wait
    runner.close()


# ------------------------------------------------------------------------ the version rule
def _drain(runner) -> list:
    """Step a rollout told to stop admitting (laminar draining towards newer weights) until its
    engine decodes nothing and no tool runs."""
    runner.admitting = False
    out: list = []
    for _ in range(400):
        if not runner.inner.status()["active"] and not runner._waiting:
            return out
        out += runner.step(4)
    raise AssertionError("the drain did not settle")


@pytest.mark.parametrize("rule", ["turn", "episode"])
def test_the_version_rule_decides_which_weights_run_the_next_turn(tok, model, rule):
    engine = Engine(model, tok, EngineOptions(max_new_tokens=24, capacity=6, seed=3))
    runner = EpisodeEngine(
        engine, AlwaysCalls(tok, delay=0.01), tok, EpisodeLimits(max_turns=2, version_rule=rule)
    )
    runner.version = 0
    runner.submit(_requests())
    done = runner.step(1)  # every first turn is admitted under version 0
    done += _drain(runner)
    st = runner.status()
    if rule == "episode":
        # every episode ran to its end under version 0: nothing is parked, nothing pins a pull
        assert st["parked"] == 0 and st["active"] == 0 and len(done) == 6
        assert {(t.version, t.last_version) for t in done} == {(0, 0)}
        return
    # turn rule: each answered episode waits for the pull, holding no engine row; it is parked
    parked = len(runner._held)
    assert parked > 0 and st["parked"] == st["active"] == parked and len(done) + parked == 6
    runner.load_state({k: v.numpy() for k, v in model.state_dict().items()}, 1)
    runner.admitting = True
    later = []
    while runner.status()["active"] or runner.status()["queued"]:
        later += runner.step(24)
    assert len(later) == parked and {(t.version, t.last_version, t.turns) for t in later} == {(0, 1, 2)}
    assert all(t.last_version == 0 for t in done)
    # a parked episode hands over bound to no version; one waiting on its tool does too
    runner.submit(_requests(2))
    runner.step(1)
    _drain(runner)
    partials, _ = runner.extract()
    assert partials and all(p.version == -1 and not p.tokens for p in partials)
    runner.close()


class JitterCalls(AlwaysCalls):
    """``AlwaysCalls`` whose tool takes a random 0-20 ms (system randomness, not seeded): which turns
    are answered by a given moment differs from run to run."""

    def step(self, state, turn):
        time.sleep(random.SystemRandom().uniform(0.0, 0.02))
        return super().step(state, turn)


def test_generate_gives_the_same_episodes_whatever_the_tool_timing(tok, model):
    """Curation and evaluation sample episodes with ``generate``: every environment answer joins before
    the next decode, so the rows decoded together (and with them the floats) never follow thread
    timing, and two runs give the same episodes token for token."""
    runs = []
    for _ in range(3):
        _, trajs = _episodes(tok, model, JitterCalls(tok), turns=3, tool_workers=4)
        runs.append([(t.response_tokens, t.behaviour_logprobs, t.turns) for t in trajs])
    assert runs[0] == runs[1] == runs[2]
    assert sum(turns for _, _, turns in runs[0]) > len(runs[0])  # episodes went past their first turn
