"""Agents through the OpenAI-compatible endpoint: the real ``openai`` client drives every request; a
multi-turn episode with ``tools=`` trains on exactly the tokens the engine consumed (a real BPE
tokenizer and chat template); a client that rewrites history is caught and never trained on; agents
that raise, hang, exit or never close end only their own episodes; bad requests get a 4xx."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from conf.schema import EngineOptions, EnvConfig
from environments.agents.adapter import AgentEnvironment, AgentParams
from environments.agents.session import Call
from environments.registry import make_environment, wrap_engine
from generation.records import GenRequest, PromptItem
from tests.environments import agent_fixtures as fx
from tests.environments.bpe import bpe_tokenizer, random_qwen2
from tests.environments.test_episodes import Recording, _consumed_matches, _training_row
from training.rl.records import episode_metrics

AGENTS = "tests.environments.agent_fixtures"


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return random_qwen2(tok)


def _cfg(agent: str, max_turns: int = 4, **params) -> EnvConfig:
    return EnvConfig(target=f"{AGENTS}:{agent}", max_turns=max_turns, tool_timeout_s=20.0, params=params)


def _requests(tok, n=4):
    texts = ["What is 12 + 7 - 3?", "What is 4 * 5?", "Compute 9 - 2 + 1."]
    out = []
    for i in range(n):
        text = texts[i % 3]
        item = PromptItem(f"q{i}", text, "16", tuple(tok(text)["input_ids"]))
        out.append(GenRequest(item, sample_idx=i % 2, group_uid=i))
    return out


def _run(engine, cfg, tok, n=4):
    runner = wrap_engine(engine, cfg, tok)
    try:
        return runner, runner.generate(_requests(tok, n))
    finally:
        runner.close()


def test_multi_turn_episode_with_tools_trains_on_the_tokens_the_engine_consumed(tok, model):
    engine = Recording(model, tok, EngineOptions(max_new_tokens=24, capacity=4, seed=3))
    runner, trajs = _run(engine, _cfg("three_turns"), tok)
    assert [t.end_reason for t in trajs] == ["answer"] * 4
    for t in trajs:
        assert t.turns == 3 and t.env_state["requests"] == 3 and t.env_state["mismatches"] == 0
        assert t.env_state["result"] == {"answer": t.env_state["result"]["answer"], "reward": 1.0}
        assert len(t.response_tokens) == len(t.behaviour_logprobs) == len(t.loss_mask)
        row = _training_row(t, tok)
        assert row == t.prompt.prompt_tokens + t.response_tokens
        assert _consumed_matches(row, t, engine)
        # the first context is the template's rendering of the agent's messages with its tools
        first = tok.apply_chat_template(
            [{"role": "system", "content": "Use calc."}, {"role": "user", "content": t.prompt.text}],
            tools=[fx.CALC],
            add_generation_prompt=True,
            tokenize=True,
        )
        first = first["input_ids"] if hasattr(first, "input_ids") or isinstance(first, dict) else first
        assert t.prompt.prompt_tokens == tuple(first)
        mine = [
            k
            for k in engine.sampled
            if k[0].split("|")[0] == t.prompt.prompt_id and k[1:] == (t.group_uid, t.sample_idx)
        ]
        assert sum(t.loss_mask) == sum(len(engine.sampled[k]) for k in mine)
    assert episode_metrics(trajs)["episode/policy_token_share"] < 1.0


def test_tool_calls_are_parsed_in_the_models_format_and_answered_token_exact(tok):
    call = '<tool_call>{"name": "calc", "arguments": {"input": "12+7-3"}}</tool_call>'
    engine = fx.Scripted(tok, ["Let me use the tool. " + call, call, "The answer is 16."])
    runner, trajs = _run(engine, _cfg("three_turns"), tok, n=2)
    for t in trajs:
        assert t.end_reason == "answer" and t.tool_calls == 2 and t.turns == 3
        assert t.env_state["result"]["answer"] == "The answer is 16."
        row = _training_row(t, tok)
        assert _consumed_matches(row, t, engine)
        # the observations are the template's tool message and the next assistant header
        text = tok.decode(list(t.response_tokens))
        assert text.count("<tool_response>\n16\n</tool_response>") == 2
        # the policy's tokens are the scripted turns, untouched by the template's own rendering
        policy = [tok_id for tok_id, m in zip(t.response_tokens, t.loss_mask) if m]
        assert tok.decode(policy).startswith("Let me use the tool. <tool_call>")


def test_a_client_that_rewrites_history_is_detected_counted_and_not_trained_on(tok, model):
    engine = Recording(model, tok, EngineOptions(max_new_tokens=16, capacity=4, seed=3))
    _, trajs = _run(engine, _cfg("rewrites_history"), tok, n=3)
    assert all(t.env_state["mismatches"] == 1 and t.env_state["untrained"] for t in trajs)
    assert all(sum(t.loss_mask) == 0 and len(t.loss_mask) == len(t.response_tokens) for t in trajs)
    assert all(t.env_state["reward"] == 0.5 and t.end_reason == "answer" for t in trajs)
    assert episode_metrics(trajs)["episode/agent_mismatch"] == 1.0
    # the positive control: the same run without the rewrite has none
    _, good = _run(
        Recording(model, tok, EngineOptions(max_new_tokens=16, capacity=4, seed=3)),
        _cfg("three_turns"),
        tok,
        3,
    )
    assert episode_metrics(good)["episode/agent_mismatch"] == 0.0


def test_faults_end_only_their_own_episode_with_a_reason(tok, model):
    for agent, reason, params in [
        ("raises", "agent_error", {}),
        ("hangs", "agent_timeout", {"episode_timeout_s": 1.0}),
        ("exits", "agent_exit", {}),
    ]:
        engine = fx.Scripted(tok, ["a turn"])
        t0 = time.monotonic()
        _, trajs = _run(engine, _cfg(agent, **params), tok, n=2)
        assert [t.end_reason for t in trajs] == [reason] * 2, agent
        assert time.monotonic() - t0 < 15
        if agent == "raises":
            assert all(t.env_state["error"] == "RuntimeError: the agent broke" for t in trajs)


def test_faulty_agents_beside_good_ones_end_only_their_own_episodes(tok):
    engine = fx.Scripted(tok, ["a turn"])
    _, trajs = _run(engine, _cfg("mixed", episode_timeout_s=2.0), tok, n=6)
    reasons = {t.prompt.prompt_id: t.end_reason for t in trajs}
    assert reasons == {"q0": "agent_error", "q1": "agent_timeout", "q2": "agent_exit", "q3": "answer",
                       "q4": "answer", "q5": "answer"}  # fmt: skip
    good = [t for t in trajs if t.prompt.prompt_id in ("q4", "q5")]
    assert all(t.turns == 3 and _consumed_matches(_training_row(t, tok), t, engine) for t in good)
    assert episode_metrics(trajs)["episode/agent_failed"] == 0.5


def test_a_hundred_sessions_never_closed_do_not_stall_the_run(tok, model):
    engine = fx.Scripted(tok, ["a turn"])
    cfg = EnvConfig(target=f"{AGENTS}:hangs", max_turns=3, tool_timeout_s=30.0, tool_workers=8,
                    params={"episode_timeout_s": 2.0})  # fmt: skip
    runner = wrap_engine(engine, cfg, tok)
    t0 = time.monotonic()
    trajs = runner.generate(_requests(tok, 100))
    took = time.monotonic() - t0
    assert [t.end_reason for t in trajs] == ["agent_timeout"] * 100, {t.env_state.get("error") for t in trajs}
    assert took < 25, took
    assert runner.env.hub.live() == 0
    runner.close()


def test_a_batch_larger_than_max_sessions_is_admitted_as_sessions_end_none_refused(tok):
    """Curation and evaluation hand ``generate`` thousands of episodes at once: past ``max_sessions``
    they wait for a session, never end as ``agent_capacity``."""
    call = '<tool_call>{"name": "calc", "arguments": {"input": "1+1"}}</tool_call>'
    engine = fx.Scripted(tok, [call, call, "done"])
    runner, trajs = _run(engine, _cfg("three_turns", max_sessions=3), tok, n=8)
    assert [t.end_reason for t in trajs] == ["answer"] * 8, [t.env_state for t in trajs]
    assert all(t.turns == 3 for t in trajs)
    assert [t.prompt.prompt_id for t in trajs] == [f"q{i}" for i in range(8)]
    assert runner.env.hub.started == 8 and runner.env.hub.live() == 0


def test_agents_that_never_ask_are_waited_for_together_not_one_after_another(tok):
    runner = wrap_engine(fx.Scripted(tok, ["a turn"]), _cfg("silent", request_timeout_s=1.0), tok)
    try:
        t0 = time.monotonic()
        trajs = runner.generate(_requests(tok, 24))
        assert [t.end_reason for t in trajs] == ["agent_timeout"] * 24
        assert all(
            t.response_tokens == () and t.env_state["error"] == "no first request in time" for t in trajs
        )
        assert time.monotonic() - t0 < 12  # 24 waits of 1 s, in parallel
        assert runner.env.hub.live() == 0
    finally:
        runner.close()


def test_a_lost_session_restarts_its_episode_once_from_the_prompt(tok, model):
    """Resume: a parked episode whose session is in no process (a fresh environment) restarts."""
    call = '<tool_call>{"name": "calc", "arguments": {"input": "1+1"}}</tool_call>'
    cfg = _cfg("three_turns")
    first = wrap_engine(fx.Scripted(tok, [call, call, "done"]), cfg, tok)
    first.submit(_requests(tok, 1))
    first.step(1)  # the first turn is with the agent
    partials, queued = first.extract()
    assert len(partials) == 1 and not queued and partials[0].request.episode.pending is not None
    first.close()
    again = wrap_engine(fx.Scripted(tok, [call, call, "done"]), cfg, tok)
    again.inject(partials)
    out = []
    while len(out) < 1:
        out += again.step(1)
    (t,) = out
    assert t.end_reason == "answer" and t.turns == 3 and again.env.hub.started == 1
    assert again.env_errors == 1  # counted once
    again.close()


def test_streaming_models_and_refusals(tok):
    runner = wrap_engine(fx.Scripted(tok, ["streamed answer"]), _cfg("streams"), tok)
    try:
        (t,) = runner.generate(_requests(tok, 1))
        assert t.end_reason == "answer" and t.env_state["result"]["answer"] == "streamed answer"
        _refusals(runner.env)
    finally:
        runner.close()


def _refusals(env: AgentEnvironment):
    s = env.hub.open({"prompt": "x"})  # a live session the checks below address
    url = env.endpoint.base_url(s.sid)

    async def check():
        good = openai.AsyncOpenAI(base_url=url, api_key=env.hub.token, max_retries=0)
        models = await good.models.list()
        assert [m.id for m in models.data] == [AgentParams().model_name]
        msgs = [{"role": "user", "content": "hi"}]
        bad = openai.AsyncOpenAI(base_url=url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model="m", messages=msgs)
        for kw in [
            {"n": 17},  # above MAX_N (n=2 reaches the session, which refuses it under training: below)
            {"temperature": 3.0},
            {"tool_choice": "required", "tools": [fx.CALC]},
            {"top_logprobs": 3, "logprobs": True},
        ]:
            with pytest.raises(openai.BadRequestError):
                await good.chat.completions.create(model="m", messages=msgs, **kw)
        with pytest.raises(openai.BadRequestError):
            await good.chat.completions.create(
                model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}]
            )
        with pytest.raises(openai.BadRequestError):
            await good.completions.create(model="m", prompt="x", echo=True)
        other = openai.AsyncOpenAI(
            base_url=env.endpoint.base_url("nope"), api_key=env.hub.token, max_retries=0
        )
        with pytest.raises(openai.NotFoundError):
            await other.chat.completions.create(model="m", messages=msgs)
        # the session in a header instead of the URL: it reaches the session, whose agent has a request open
        deadline = time.monotonic() + 10
        while s.call is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        root = env.endpoint.base_url()
        for sid, error in ((s.sid, openai.ConflictError), ("nope", openai.NotFoundError)):
            hdr = openai.AsyncOpenAI(base_url=root, api_key=env.hub.token, max_retries=0,
                                     default_headers={"X-Laminar-Session": sid})  # fmt: skip
            with pytest.raises(error):
                await hdr.chat.completions.create(model="m", messages=msgs)
            await hdr.close()
        await good.close(), await bad.close(), await other.close()

    asyncio.run(check())
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    req = urllib.request.Request(url + "/chat/completions", data=big, method="POST")
    req.add_header("Authorization", f"Bearer {env.hub.token}")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 413
    env.hub.close(s.sid)


def test_the_agents_return_is_the_reward_through_the_reward_layer(tok):
    from conf.schema import RewardComponentConfig, RewardConfig
    from rewards.compose import open_reward
    from training.rl.loop import score_phase

    engine = fx.Scripted(tok, ["#### 7"])
    _, trajs = _run(engine, _cfg("rewrites_history"), tok, n=2)  # returns 0.5
    _, answered = _run(fx.Scripted(tok, ["#### 16"]), _cfg("streams"), tok, n=2)  # returns an answer
    cfg = RewardConfig(
        components=[RewardComponentConfig.of(target="rewards.agent:agent_return", verdict=True)]
    )
    verifier, reward = open_reward(cfg, 10.0)
    with verifier:
        (group,) = score_phase(trajs[:1], reward)
        (right,) = score_phase(answered[:1], reward)
    assert group.rewards == (0.5,) and group.correct == (False,)  # 0.5 is below the threshold 1.0
    assert right.correct == (True,)  # no reward returned: its final answer matches the gold 16


def test_completions_sessions_are_token_exact_and_return_the_behaviour_logprobs(tok):
    engine = fx.Scripted(tok, ["first part", "second part"])
    _, trajs = _run(engine, _cfg("completes"), tok, n=2)
    for t in trajs:
        assert t.end_reason == "answer" and t.turns == 2 and t.env_state["mismatches"] == 0
        assert _consumed_matches(_training_row(t, tok), t, engine)
        policy = [lp for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if m]
        sent = [lp for turn in t.env_state["result"]["logprobs"] for lp in turn]
        assert sent == policy == [-0.5] * len(policy)  # every policy token's, EOS included
        obs = [i for i, m in zip(t.response_tokens, t.loss_mask) if not m]
        assert tok.decode(obs) == " Next:"


def test_a_malformed_request_gets_a_400_and_the_episode_goes_on(tok):
    _, trajs = _run(fx.Scripted(tok, ["fine"]), _cfg("malformed_first"), tok, n=2)
    for t in trajs:
        assert t.end_reason == "answer" and t.turns == 1
        assert t.env_state["result"]["status"] == 400
        assert t.env_state["result"]["logprobs"] == [-0.5] * len(t.response_tokens)


def test_a_request_the_policy_never_answers_times_out_with_a_504(tok):
    env = make_environment(_cfg("silent", request_timeout_s=0.5), tok)
    try:
        env.endpoint  # noqa: B018 - started (as the first reset starts it)
        s = env.hub.open({"prompt": "x"})  # its agent never asks: the requests below are the only ones
        client = openai.OpenAI(base_url=env.endpoint.base_url(s.sid), api_key=env.hub.token, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 504 and time.monotonic() - t0 < 5
        # a second request while the first waits on the policy is refused
        waiting = Call({})
        s.post(waiting)
        with pytest.raises(openai.ConflictError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert s.call is waiting
    finally:
        env.close()


def test_an_episode_cut_by_its_turn_limit_stops_its_agent(tok):
    runner = wrap_engine(fx.Scripted(tok, ["a turn"]), _cfg("three_turns", max_turns=2), tok)
    try:
        trajs = runner.generate(_requests(tok, 3))
        assert [t.end_reason for t in trajs] == ["max_turns"] * 3
        assert runner.env.hub.live() == 0 and not runner.env.hub.sessions  # none outlives its episode
    finally:
        runner.close()


def test_an_agent_target_is_checked_before_any_write(tmp_path, monkeypatch):
    from core.plugins import PluginError
    from environments.registry import check_environment

    assert check_environment(_cfg("raises")) == f"{AGENTS}:raises"
    (tmp_path / "bad_agents.py").write_text("async def solve(client, task, extra):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="wrong signature"):
        check_environment(EnvConfig(target="bad_agents:solve", max_turns=2))
    with pytest.raises(PluginError, match="episode_timeout: Extra inputs are not permitted"):
        check_environment(_cfg("raises", episode_timeout=3))


def test_untrained_and_empty_agent_episodes_move_no_weight_under_every_objective(tok):
    """A history mismatch keeps its tokens with loss mask 0; an agent that failed before its first
    request leaves an empty episode: beside a normal one, every preset's update stays finite."""
    import torch

    from generation.records import ScoredGroup, Trajectory
    from training.objectives import PRESETS
    from training.rl.trainer import PolicyTrainer

    p = PromptItem("a", "x", "1", (1, 2, 3))
    empty = Trajectory("trajectory", p, 0, (), (), 0, False, "", 0.0, 0, end_reason="agent_exit")
    zero = Trajectory("trajectory", p, 1, (7, 8, 9), (-0.1,) * 3, 0, True, "", 0.0, 0, loss_mask=(0, 0, 0))
    good = Trajectory("trajectory", p, 2, (4, 5), (-0.1, -0.2), 0, True, "", 0.0, 0, loss_mask=(1, 1))
    group = ScoredGroup("scored_group", "a", (empty, zero, good), (0.0, 0.0, 1.0), (False, False, True))
    for name, params in PRESETS.items():
        if params.distill_weight:  # opd: its teacher is another test's (tests/training/test_opd.py)
            continue
        model = random_qwen2(tok)
        trainer = PolicyTrainer(model, params, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, temperature=1.0,
                                max_new_tokens=24, pad_id=tok.pad_token_id, device="cpu")  # fmt: skip
        stats = trainer.update([group])
        assert stats.n_tokens == 2, name  # only the normal episode's two policy tokens
        assert all(torch.isfinite(q).all() for q in model.parameters()), name


def test_stop_cuts_the_text_returned_never_the_tokens_and_tool_choice_none_parses_no_call(tok):
    call = '<tool_call>{"name": "calc", "arguments": {"input": "9+7"}}</tool_call>'
    turn = "It is 16 " + call
    (t,) = _run(fx.Scripted(tok, [turn]), _cfg("stops"), tok, n=1)[1]
    assert t.env_state["result"] == {"content": "It is ", "calls": 0, "finish": "stop"}
    policy = [i for i, m in zip(t.response_tokens, t.loss_mask) if m]
    assert tok.decode(policy, skip_special_tokens=True) == turn  # the whole turn as sampled is trained on


def test_the_example_agent_on_the_tiny_tokenizer_gives_the_calculators_own_episode():
    """Without a chat template (the tiny model's character tokenizer) a session speaks the calculator's
    line format: the example ReAct agent's episode is token for token the two-turn tool episode that
    warm-up imitates under env=calculator (``ToolEnvironment.demonstration``)."""
    from environments.calculator import Calculator
    from environments.tool_use import ToolCall, ToolEnvironment
    from generation.model import build_char_tokenizer, encode_prompt

    tok = build_char_tokenizer()
    item = PromptItem("q0", "What is 3+4?", "7", encode_prompt(tok, "What is 3+4?"))
    engine = fx.Scripted(tok, ["calc: 3+4", "#### 7"])
    cfg = EnvConfig(target="examples.agents.react_calc:solve", max_turns=4, tool_timeout_s=20.0)
    runner = wrap_engine(engine, cfg, tok)
    try:
        (t,) = runner.generate([GenRequest(item, 0, 0)])
    finally:
        runner.close()
    assert t.end_reason == "answer" and t.tool_calls == 1 and t.turns == 2
    assert t.env_state["result"] == {"answer": "#### 7", "tool_calls": 1}
    assert t.prompt.prompt_tokens == item.prompt_tokens  # the prompt's own tokens, not a re-encoding
    calculator = ToolEnvironment("calculator", [Calculator()], tok, "text")
    tokens, mask = calculator.demonstration(ToolCall("calc", "3+4"), "#### 7")
    assert (t.response_tokens, t.loss_mask) == (tokens, mask)
    assert _consumed_matches(_training_row(t, tok), t, engine)


def _logprobs_at(model, context, tokens, temperature):
    """The log-probs of ``tokens`` after ``context`` under ``model`` at ``temperature``."""
    import torch

    ids = torch.tensor([list(context) + list(tokens)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 : -1].float() / temperature
    lps = torch.log_softmax(logits, -1)
    return lps[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


OFF_THE_RUN = [{"n": 2}, {"temperature": 0.2}, {"top_p": 0.5}, {"max_tokens": 4}]


@pytest.mark.parametrize("policy", ["refuse", "run"])
def test_under_training_a_request_off_the_runs_sampling_is_refused_or_served_at_the_runs(tok, model, policy):
    """The engine samples every turn at the run's temperature and cap: a request asking for another
    ``temperature``, ``top_p`` or a shorter ``max_tokens`` gets a 400 naming the run's value
    (``sampling=refuse``), or is served at the run's settings and counted (``sampling=run``); ``n>1``
    is refused either way. What is trained, and what the agent is told, is the log-probs of the
    distribution actually sampled (temperature 0.8 here, checked against the model)."""
    engine = Recording(model, tok, EngineOptions(max_new_tokens=12, capacity=4, seed=3, temperature=0.8))
    params = {"off": OFF_THE_RUN, "run": {"temperature": 0.8, "top_p": 1.0, "max_tokens": 64}}
    cfg = _cfg("sampling_probe", sampling=policy, agent_params=params)
    _, (t,) = _run(engine, cfg, tok, n=1)
    result = t.env_state["result"]
    if policy == "refuse":
        assert result["statuses"] == [400, 400, 400, 400, 200] and "sampling_overridden" not in t.env_state
        for kw, message in zip(OFF_THE_RUN, result["messages"]):
            ((key, value),) = kw.items()
            assert f"{key}={value:g}" in message
        assert "the run samples at 0.8" in result["messages"][1] and "12 tokens" in result["messages"][3]
        assert "session does not branch" in result["messages"][0]
    else:  # n=2 still refused; temperature=0.2 served at 0.8 and counted
        assert result["statuses"] == [400, 200] and t.env_state["sampling_overridden"] == 1
    overridden = episode_metrics([t])["episode/agent_sampling_overridden"]
    assert overridden == (1.0 if policy == "run" else 0.0)
    turn = len(t.response_tokens) if t.turns == 1 else t.loss_mask.index(0)
    sampled = t.response_tokens[:turn]
    want = _logprobs_at(model, t.prompt.prompt_tokens, sampled, 0.8)
    assert result["lps"] == pytest.approx(want, abs=1e-4)
    assert list(t.behaviour_logprobs[:turn]) == pytest.approx(want, abs=1e-4)
    assert _logprobs_at(model, t.prompt.prompt_tokens, sampled, 0.2) != pytest.approx(want, abs=1e-3)
