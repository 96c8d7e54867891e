"""Real pretrained models in a workspace: ``laminar model fetch NAME`` and ``model=NAME`` on first use.

The fetched model is an artifact of kind ``pretrained`` (``generation.pretrained``); a run takes it as
``model.path``, so every stage loads it through the ``model=hf`` path and its base-model stage copies it
(with its ``provenance.json``) into the run's own lineage.
"""

from __future__ import annotations

from collections.abc import Callable

from conf.schema import Config
from core.artifacts import ArtifactRef
from core.workspace import Workspace


def fetch_model(ws: Workspace, name: str, progress: Callable[[str], None] = print) -> ArtifactRef:
    """The stored conversion of pretrained model ``name``, fetched and converted once."""
    from generation.pretrained import fetch

    ws.create()
    with ws.lock():
        return fetch(ws.artifacts, name, ws.root / "cache", progress)


def with_pretrained(
    cfg: Config, overrides: list[str], ws: Workspace, progress: Callable[[str], None] = print
) -> list[str]:
    """``overrides`` with ``model.path=<the fetched folder>`` added when the config names a pretrained
    model and no path (``model=smollm2``); unchanged otherwise."""
    name = cfg.model.pretrained
    if name is None or cfg.model.path:
        return list(overrides)
    ref = fetch_model(ws, name, progress)
    return [*overrides, f"model.path={ref.path}"]
