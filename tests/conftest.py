import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `make test` runs two pytest processes on 2 cores: one torch thread per process (and per `laminar`
# subprocess, which inherits it) instead of oversubscribed threads that spin against each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402 - after the environment above, which imported libraries read


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray instance for one test module: 2 CPUs, the actors' environment as the runtime starts
    them (``actor_env``); skipped where Ray is not installed."""
    ray = pytest.importorskip("ray")
    from training.rl.drivers.ray import actor_env

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": actor_env(1)},
    )
    yield ray
    ray.shutdown()
