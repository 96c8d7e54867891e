"""The learned reward model in its own Ray actor: rollouts never load it, and the driver sends it
finished groups to score. A reward actor that dies is restarted by Ray and the batch it held is sent
again (``max_task_retries``), so no trajectory goes unscored or is counted twice: the manager takes
each group's scores once, from the call that returned."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rewards.components import Sample
from rewards.reward_model import RewardModelComponent


class RewardModelWorker:
    """The actor's body: the ``reward_model`` component over its checkpoint, scoring batches."""

    def __init__(self, params, path: str, template: str) -> None:
        self.component = RewardModelComponent(params, path, template)
        self.calls = 0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        self.calls += 1
        return self.component.score(samples, correct)

    def count(self) -> int:
        """Batches this incarnation of the actor scored."""
        return self.calls

    def pid(self) -> int:
        import os

        return os.getpid()


@dataclass
class RemoteRewardModel:
    """Stands in for a ``RewardModelComponent`` in the driver's reward: same name, parameters and
    fallback; ``score`` is a call to the actor ``handle``."""

    handle: object
    params: object
    name: str = "reward_model"
    correctness: bool = False
    fallback: float = 0.0

    def score(self, samples: Sequence[Sample], correct: Sequence[bool]) -> list[float]:
        import ray

        return ray.get(self.handle.score.remote(list(samples), list(correct)))


def with_reward_actor(ray, reward, num_cpus: float = 0.0):
    """``reward`` (a ``rewards.compose.Reward``) with each learned reward model moved into an actor of
    its own (restarted and its call retried when it dies); other components stay in process. The actor
    reserves no CPU by default: it scores between the trainer's steps and must never wait for a slot."""
    from rewards.compose import Reward

    shaping = []
    for c in reward.shaping:
        if isinstance(c, RewardModelComponent) and c.path is not None:
            actor = ray.remote(num_cpus=num_cpus, max_restarts=-1, max_task_retries=-1)(RewardModelWorker)
            c = RemoteRewardModel(
                actor.remote(c.params, str(c.path), c.template), c.params, c.name, c.correctness, c.fallback
            )
        shaping.append(c)
    return Reward(reward.verifier, reward.weights, shaping, reward.verdict, reward.specs)
