"""Agent faults at the level of an RL run (issue 52): agents that raise, hang past their timeout (asleep, or
blocking their own thread), open 100 clients they never close, send malformed requests or requests without the
token run beside good agents in one run of the real rollout manager: sync and partial with an in-process
rollout (partial: groups overtake the hanging one), partial and laminar on the Ray runtime (slow). Each fault
ends only its own episode, with its reason (or gets a 4xx and its episode goes on); the run finishes; every
group issued is trained once or is still in flight at the end (none lost, none twice); no agent session, agent
thread or endpoint connection outlives its episode. Then the endpoint fixes the scenario needed, one test each
(each fails on the base commit).

The scenario (``fault_run``) is also ``benchmarks/agent_faults.py``'s, which tabulates it."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from conf.schema import EnvConfig, RLConfig
from environments.agents.session import Hub
from generation.model import build_char_tokenizer, encode_problem
from generation.records import PromptItem, Trajectory
from tests.environments import agent_fixtures as fx
from tests.environments.episode_helpers import CALL, teach
from tests.training.rl_fakes import Verdict, saved_model
from training.rl.drivers.local import LocalDriver
from training.rl.manager import ManagerSettings, RolloutManager
from training.rl.sections import RLSections
from training.rl.stage import objective_params

EPISODE_TIMEOUT_S = 12.0
"""The hanging agent's episode ends this long after its start (``agent_timeout``); every other agent's
episode ends well within it, also on a loaded machine."""
IDLE_S = 2.0
"""The endpoint closes a connection idle this long (the leaked clients' connections)."""
REASONS = {"raise": "agent_error", "hang": "agent_timeout", "block": "agent_timeout"}
"""The end reason of each fault that ends its episode; the others (and good agents) end ``answer``."""
STATUSES = {
    "leak": [200] * fx.LEAKED_CLIENTS,
    "malformed": [400] * len(fx.MALFORMED_BODIES),
    "noauth": [401, 401],
    "good": [],
}
"""What each agent that answers saw before its two good requests (200, 200)."""


class Ordered:
    """The prompt source: the pool in its order (faults first), then again."""

    def __init__(self, prompts):
        self.prompts, self.position = list(prompts), 0

    def take(self, n):
        out = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(n)]
        self.position += n
        return out

    def observe(self, groups):
        pass

    def step_counts(self):
        return {}


class EndsWithThree:
    def verify_batch(self, texts, answers):
        return [Verdict(t.strip().endswith("3")) for t in texts]


def taught_episode(tok, steps: int = 200):
    """The tiny model taught (a few hundred SFT steps) the whole tool episode a good agent runs: call
    ``calc: 1+2``, then answer ``3`` after the result line ``= 3``."""
    rows = []
    for i in range(12):
        problem = list(encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"))
        turns = [
            *tok(CALL, add_special_tokens=False)["input_ids"],
            tok.eos_token_id,
            *tok("\n= 3\n3", add_special_tokens=False)["input_ids"],
            tok.eos_token_id,
        ]
        rows.append(problem + turns)
    return teach(tok, rows, steps=steps, lr=3e-3)


def fault_prompts(tok, n_good: int) -> list[PromptItem]:
    """One prompt per fault (id ``KIND-0``) then ``n_good`` good ones (``good-I``)."""
    ids = [f"{k}-0" for k in fx.FAULT_KINDS] + [f"good-{i}" for i in range(n_good)]
    return [
        PromptItem(p, f"{i % 4}+{i % 3}", "3", encode_problem(tok, "{problem}\n", f"{i % 4}+{i % 3}"), 1)
        for i, p in enumerate(ids)
    ]


@dataclass
class FaultRun:
    """What a run of the scenario left: the driver (its manager, its engine and the agents' hub), the
    groups the trainer took (uid, group) in order, every trajectory that finished (trained or not), the
    history and the wall seconds."""

    driver: LocalDriver
    trained: list = field(default_factory=list)
    finished: list[Trajectory] = field(default_factory=list)
    history: list = field(default_factory=list)
    wall: float = 0.0
    sessions: list = field(default_factory=list)
    """Every agent session the run opened (``environments.agents.session.Session``), in order."""


def fault_run(folder, mode: str, *, steps: int = 3, prompts_per_step: int = 4, group_size: int = 2,
              seed: int = 0, model_dir=None, ray: bool = False) -> FaultRun:  # fmt: skip
    """The scenario: the tiny model taught the good agent's tool episode (``taught_episode``; or the
    one in ``model_dir``), the ``faulty`` agent on one prompt per fault and good ones for the rest of
    ``steps`` batches, one in-process rollout under the real rollout manager in ``mode`` (``sync``:
    the local driver as it is; ``partial``: the same loop with the manager deciding as for
    ``rl.mode=partial``: interrupts at each update, no batches); with ``ray``, the Ray runtime
    (``LaminarRuntime``, two rollout actors, any mode): its sessions are in the actors, not in
    ``sessions``."""
    tok = build_char_tokenizer()
    prompts = fault_prompts(tok, steps * prompts_per_step - len(fx.FAULT_KINDS))
    kw = dict(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size, lr=1e-3,
              max_new_tokens=12, temperature=0.5, rollout_capacity=8, chunk_steps=4,
              micro_batch_tokens=0)  # fmt: skip
    rl = RLConfig(mode="sync", runtime="local", **kw)
    env = EnvConfig(
        target="tests.environments.agent_fixtures:faulty",
        max_turns=3,
        tool_timeout_s=60.0,  # the agent's time between two requests: longer than its episode's limit
        params={
            "episode_timeout_s": EPISODE_TIMEOUT_S,
            "request_timeout_s": 60.0,
            "idle_timeout_s": IDLE_S,
            "agent_params": {"block_s": EPISODE_TIMEOUT_S + 1},
        },  # fmt: skip
    )
    params = objective_params(rl)
    model_dir = model_dir or saved_model(folder, taught_episode(tok), tok)
    source = lambda cursor, policy: Ordered(prompts)  # noqa: E731
    if ray:
        from conf.schema import ClusterConfig
        from training.rl.drivers.ray import LaminarRuntime

        sections = RLSections(RLConfig(mode=mode, runtime="ray", max_staleness=4, **kw), seed=seed,
                              cluster=ClusterConfig(rollouts=2, actor_threads=1), env=env)  # fmt: skip
        driver = LaminarRuntime(
            model_dir, prompts, EndsWithThree(), params, sections, device="cpu", source=source
        )
    else:
        driver = LocalDriver(model_dir, prompts, EndsWithThree(), params, RLSections(rl, seed=seed, env=env),
                             device="cpu", source=source)  # fmt: skip
    if mode != "sync" and not ray:  # the local driver's loop under another mode's decisions
        driver.rl = RLConfig(mode=mode, runtime="ray", **kw)
        driver.settings = ManagerSettings.from_config(driver.rl, params)
    run = FaultRun(driver)
    next_batch, step_done, hub_open = RolloutManager.next_batch, RolloutManager.step_done, Hub.open

    def spy_batch(manager):
        groups = next_batch(manager)
        run.trained.extend(groups)
        return groups

    def spy_done(manager, name, finished, status, pulled):
        finished = list(finished)
        run.finished.extend(finished)
        return step_done(manager, name, finished, status, pulled)

    def spy_open(hub, task):
        session = hub_open(hub, task)
        run.sessions.append(session)
        return session

    mp = pytest.MonkeyPatch()
    mp.setattr(Hub, "open", spy_open)
    mp.setattr(RolloutManager, "next_batch", spy_batch)
    mp.setattr(RolloutManager, "step_done", spy_done)
    t0 = time.monotonic()
    try:
        run.history = driver.run().history
    finally:
        run.wall = time.monotonic() - t0
        mp.undo()
    return run


def unfinished_uids(manager: RolloutManager) -> set[int]:
    """Groups issued and not completed when the run ended: in flight, or waiting in the buffer."""
    uids = {q.group_uid for q in manager.in_flight()}
    return uids | set(manager.buffer.partial) | set(manager.buffer.ready)


def check_groups(run: FaultRun, steps: int, prompts_per_step: int) -> None:
    """Every group issued is trained exactly once, whole, or is still unfinished: none lost, none twice."""
    m = run.driver.manager
    uids = [u for u, _ in run.trained]
    assert len(uids) == len(set(uids)) == steps * prompts_per_step
    assert m.trained_uids == uids
    assert all(len(g.trajectories) == m.s.group_size for _, g in run.trained)
    rest = unfinished_uids(m)
    assert not rest & set(uids)
    assert set(uids) | rest == set(range(m.queue.next_uid)), "a group was lost"
    assert m.buffer.stats.duplicates == 0


def check_episodes(run: FaultRun, moved: bool = False) -> list[Trajectory]:
    """Each episode ends with its agent's reason; the faults that answer saw their 4xx (or 200s), then
    ran two good turns; good agents' episodes are whole tool episodes. With ``moved`` (laminar's
    repack), an episode may also end ``env_error``: moved twice, its one restart spent (docs/agents.md,
    "Repack and resume"); those are returned."""
    assert run.finished
    spent = []
    for t in run.finished:
        kind = fx.fault_of(t.prompt.prompt_id)
        if moved and t.end_reason == "env_error":
            spent.append(t)
            continue
        assert t.end_reason == REASONS.get(kind, "answer"), (kind, t.end_reason, t.env_state)
        if kind == "raise":
            assert t.env_state["error"] == "RuntimeError: fault: the agent broke"
        elif kind in ("hang", "block"):
            assert t.turns == 1 and t.env_state["requests"] == 1
        else:
            assert t.env_state["result"]["statuses"] == STATUSES[kind] + [200, 200], kind
            assert t.turns == 2 and t.tool_calls == 1 and 0 in t.loss_mask  # call, result, answer
            assert t.env_state["mismatches"] == 0 and t.env_state["requests"] == 2
    return spent


def check_metrics(run: FaultRun) -> None:
    """``episode/agent_failed`` counts exactly the raising, hanging and blocking episodes the trainer
    took (``episode/failed``: exactly the ``env_error`` ones)."""
    failed = sum(
        t.end_reason in ("agent_error", "agent_timeout") for _, g in run.trained for t in g.trajectories
    )
    per_step = [d.as_dict() for d in run.history]
    counted = sum(d["episode/agent_failed"] * d["trained_trajectories"] for d in per_step)
    assert round(counted) == failed
    assert all(d["episode/agent_mismatch"] == 0.0 for d in per_step)
    spent = sum(t.end_reason == "env_error" for _, g in run.trained for t in g.trajectories)
    assert round(sum(d["episode/failed"] * d["trained_trajectories"] for d in per_step)) == spent


def server_threads() -> int:
    """The endpoint's connection threads alive now (one per open connection)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def connections_closed(timeout: float) -> bool:
    """Whether every endpoint connection closes within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while server_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    return server_threads() == 0


def agents_ended(run: FaultRun, timeout: float) -> bool:
    """Whether the thread of every agent the run started (``Hub`` runs each on its own) ends within
    ``timeout`` seconds."""
    names = {f"agent-{s.sid[:8]}" for s in run.sessions}
    deadline = time.monotonic() + timeout
    while any(t.name in names for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(t.name in names for t in threading.enumerate())


STEPS, PER_STEP = 3, 4


@pytest.fixture(scope="module")
def episode_model(tmp_path_factory):
    tok = build_char_tokenizer()
    return saved_model(tmp_path_factory.mktemp("episode-model"), taught_episode(tok), tok)


@pytest.mark.parametrize("mode", ["sync", "partial"])
def test_faulty_agents_end_only_their_own_episodes_and_every_other_group_trains_once(
    tmp_path, mode, episode_model
):
    run = fault_run(tmp_path, mode, steps=STEPS, prompts_per_step=PER_STEP, model_dir=episode_model)
    assert len(run.history) == STEPS
    check_groups(run, STEPS, PER_STEP)
    check_episodes(run)
    check_metrics(run)
    uids = [u for u, _ in run.trained]
    if mode == "sync":  # each batch waits for its slowest episode: groups train in the order issued
        assert uids == sorted(uids)
    else:  # groups issued after the hanging one trained before it: the run did not wait for it
        assert uids != sorted(uids) and uids.index(1) > uids.index(3), uids
    kinds = {fx.fault_of(g.prompt_id) for _, g in run.trained}
    assert kinds == {*fx.FAULT_KINDS, "good"}  # every fault reached the trainer, beside good groups
    engine = run.driver.engine
    assert engine.env_errors == 0  # no fault reached the episode runner as a crash
    hub, in_flight = engine.env.hub, len(run.driver.manager.in_flight())
    if mode == "sync":  # nothing is in flight after the last update: every session and agent has ended
        assert in_flight == 0 and hub.live() == 0 and all(s.end is not None for s in run.sessions)
        assert agents_ended(run, 5.0)
        with pytest.raises(ConnectionRefusedError):  # the run closed its endpoint when it ended
            socket.create_connection(("127.0.0.1", engine.env._endpoint.port), timeout=5).close()
    assert hub.live() <= in_flight  # the sessions left are the episodes still running, no other
    assert len(run.finished) <= hub.started <= len(run.finished) + in_flight  # none restarted
    assert len(fx.LEAKED) >= 2 * fx.LEAKED_CLIENTS  # the leaked clients are still held
    if mode == "sync":  # yet the endpoint closed their idle connections (and every other)
        assert connections_closed(2 * IDLE_S), server_threads()
    engine.close()  # idempotent: the local driver closed it when its run ended
    assert hub.live() == 0 and all(s.end is not None for s in run.sessions) and agents_ended(run, 5.0)
    assert connections_closed(2 * IDLE_S), server_threads()
    fx.LEAKED.clear()
    assert run.wall < 120, (
        run.wall
    )  # bounded: the hanging agent costs its 12 s, never a request timeout (60 s)


# ------------------------------------------------------------------ the endpoint's fixes, one at a time
def _session_env(**params):
    """An agent environment (its agent never asks) with its endpoint started and one live session."""
    from environments.registry import make_environment

    cfg = EnvConfig(target="tests.environments.agent_fixtures:silent", max_turns=2, params=params)
    env = make_environment(cfg, build_char_tokenizer())
    env.endpoint  # noqa: B018 - started, as the first reset starts it
    return env, env.hub.open({"prompt": "x", "prompt_id": "p"})


def test_malformed_bodies_get_a_400_and_reach_no_session():
    """A field of the wrong type (``tool_calls: 5``, ``stream_options: "x"``, a tool schema that is no
    object), JSON nested too deep or a Content-Length that is no number: a 400 (before the fix, the
    handler thread raised and the client saw its connection dropped, no answer)."""

    import httpx

    env, s = _session_env(request_timeout_s=1.0)
    url = env.endpoint.base_url(s.sid) + "/chat/completions"
    auth = {"Authorization": f"Bearer {env.hub.token}", "Content-Type": "application/json"}
    try:
        with httpx.Client(trust_env=False, timeout=10.0) as http:
            for name, body in fx.MALFORMED_BODIES.items():
                r = http.post(url, content=body, headers=auth)
                assert r.status_code == 400 and "malformed request" in r.json()["error"]["message"], name
        assert s.call is None and s.end is None and env.endpoint.requests == len(fx.MALFORMED_BODIES)
        with socket.create_connection(("127.0.0.1", env.endpoint.port), timeout=10) as raw:
            head = f"POST /s/{s.sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            raw.sendall(
                f"{head}Authorization: Bearer {env.hub.token}\r\nContent-Length: ten\r\n\r\n".encode()
            )
            assert raw.recv(4096).split(b"\r\n")[0].endswith(b" 400 Bad Request")
    finally:
        env.close()


def test_a_request_the_chat_template_refuses_gets_a_400_and_the_episode_goes_on():
    """A chat template that raises (``raise_exception``, as many do for roles out of order) on the
    first request or on a later one: the agent hears a 400 and goes on; before the fix, the first
    request's error stopped the rollout (out of ``reset``) and a later one's restarted the episode."""
    from environments.registry import wrap_engine
    from generation.records import GenRequest
    from tests.environments.bpe import CHAT_TEMPLATE, bpe_tokenizer

    tok = bpe_tokenizer()
    refuse = "{% for m in messages %}{% if '" + fx.REFUSED + "' in m.content %}"
    tok.chat_template = refuse + "{{ raise_exception('refused') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE
    cfg = EnvConfig(
        target="tests.environments.agent_fixtures:template_refused", max_turns=3, tool_timeout_s=20.0
    )
    runner = wrap_engine(fx.Scripted(tok, ["fine", "done"]), cfg, tok)
    item = PromptItem("q0", "What is 4 * 5?", "20", tuple(tok("What is 4 * 5?")["input_ids"]))
    try:
        (t,) = runner.generate([GenRequest(item, 0, 0)])
        assert t.end_reason == "answer" and t.env_state["result"]["statuses"] == [400, 200, 400, 200]
        assert t.turns == 2 and runner.env_errors == 0 and runner.env.hub.started == 1  # never restarted
    finally:
        runner.close()


def test_an_idle_connection_is_closed_though_its_client_is_kept():
    """A client that never closes its connection holds no endpoint thread past ``idle_timeout_s``
    (before the fix, each held one for as long as the client lived); the client still works after."""
    import httpx

    env, s = _session_env(idle_timeout_s=0.5)
    try:
        http = httpx.Client(
            trust_env=False, timeout=10.0, headers={"Authorization": f"Bearer {env.hub.token}"}
        )
        assert http.get(env.endpoint.base_url(s.sid) + "/models").status_code == 200
        assert server_threads() == 1 and connections_closed(5.0)
        assert http.get(env.endpoint.base_url(s.sid) + "/models").status_code == 200  # it reconnects
        http.close()
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["partial", "laminar"])
def test_faulty_agents_on_the_ray_runtime(tmp_path, local_ray, episode_model, mode):
    """The same scenario on the Ray runtime (two rollout actors; the agents run in the actors'
    processes): every fault ends only its own episode with its reason and every group issued is
    trained once or still in flight. In laminar mode repack moves long-tail episodes between the
    actors (a hanging agent's episode is one): a moved episode restarts from its prompt once, and
    one moved twice ends ``env_error`` (counted in ``episode/failed``), never trained twice."""
    steps = 6
    run = fault_run(tmp_path, mode, steps=steps, prompts_per_step=PER_STEP, model_dir=episode_model,
                    ray=True)  # fmt: skip
    fx.LEAKED.clear()
    assert len(run.history) == steps
    check_groups(run, steps, PER_STEP)
    spent = check_episodes(run, moved=mode == "laminar")
    check_metrics(run)
    m, uids = run.driver.manager, [u for u, _ in run.trained]
    assert run.driver.summary["trained_uids"] == uids
    assert {fx.fault_of(g.prompt_id) for _, g in run.trained} >= {*fx.FAULT_KINDS, "good"} - {"hang", "block"}
    print(f"{mode}: {dict(m.counts)} trained {uids} unfinished {sorted(unfinished_uids(m))} "
          f"moved twice {[(t.prompt.prompt_id, t.group_uid) for t in spent]} {run.wall:.1f} s")  # fmt: skip
