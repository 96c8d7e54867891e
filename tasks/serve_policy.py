"""``laminar serve-policy CKPT``: the agent endpoint (``environments.agents.serve.PolicyServer``) over a
checkpoint (a ``save_pretrained`` folder, a LoRA adapter folder or a sha prefix in the workspace),
outside training, so an agent can be tried against it before it is trained (docs/agents.md)."""

from __future__ import annotations

import time

from core.workspace import Workspace


def serve_policy(ws: Workspace, spec: str, *, port: int, max_tokens: int, seed: int, seconds: float | None,
                 max_batch: int = 32, say=print) -> None:  # fmt: skip
    """Serve ``spec``'s model until interrupted (or for ``seconds``), decoding up to ``max_batch``
    rows (choices of concurrent requests) together; ``say`` gets the base URL and
    the bearer token as ``OPENAI_BASE_URL=...`` and ``OPENAI_API_KEY=...`` lines (an ``openai``
    client reads both from the environment)."""
    from environments.agents.serve import PolicyServer
    from generation.model import load_model
    from tasks.checkpoint_eval import resolve_checkpoint

    ref = resolve_checkpoint(ws, spec)
    model, tokenizer = load_model(ref.path)
    server = PolicyServer(model, tokenizer, port=port, max_tokens=max_tokens, seed=seed, max_batch=max_batch)
    say(f"# serving {ref.sha256[:12]} ({ref.path}) on loopback, {max_batch} rows batched; Ctrl-C stops it")
    say(f"OPENAI_BASE_URL={server.base_url}")
    say(f"OPENAI_API_KEY={server.token}")
    try:
        end = time.monotonic() + seconds if seconds else None
        while end is None or time.monotonic() < end:
            time.sleep(0.2 if end is None else max(0.0, min(0.2, end - time.monotonic())))
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
