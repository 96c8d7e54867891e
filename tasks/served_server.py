"""The Prefect server ``laminar serve`` starts (``python -m tasks.served_server --port N``): Prefect's
own app, as ``prefect server start`` runs it (API, UI and services in one process), behind a guard
that answers 403 with the reason to any request setting a flow run's or the deployment's parameters
that a run of the deployment may not choose (``tasks.serving.refused_parameters``: another workspace,
an override off the allow-list). The flow run itself checks the same again (``check_served_run``),
so a run created some other way is refused too, as a failed run."""

from __future__ import annotations

import argparse
import json
import os
import re

from tasks.serving import SERVE_SPEC_ENV, refused_parameters

_GUARDED = re.compile(r"/api/(deployments|flow_runs)(/|$)")
"""Where a request may carry ``parameters``: deployments (creation, update, schedules, a flow run
created from one) and flow runs (creation, update)."""


class ParameterGuard:
    """ASGI middleware: a POST, PUT or PATCH under ``_GUARDED`` whose JSON body sets ``parameters`` is
    checked against the served spec (``spec``: workspace and the command line's overrides) before the
    app sees it."""

    def __init__(self, app, spec: dict):
        self.app = app
        self.spec = spec

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        if not _GUARDED.search(scope["path"]):
            return await self.app(scope, receive, send)
        messages, body, more = [], b"", True
        while more:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False) and message["type"] == "http.request"
        reason = self.refusal(body)
        if reason:
            payload = json.dumps({"detail": reason}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 403,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
            return None

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    def refusal(self, body: bytes) -> str | None:
        try:
            data = json.loads(body or b"null")
        except ValueError:
            return None  # not JSON: the app answers it
        if not isinstance(data, dict) or "parameters" not in data:
            return None
        return refused_parameters(data["parameters"], self.spec)


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import (
        PREFECT_SERVER_API_KEEPALIVE_TIMEOUT,
        PREFECT_SERVER_LOGGING_LEVEL,
    )

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    app = create_app(final=True)
    if os.environ.get(SERVE_SPEC_ENV):  # what `laminar serve` fixed (``served_parameters``)
        app = ParameterGuard(app, json.loads(os.environ[SERVE_SPEC_ENV]))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        timeout_keep_alive=PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
        log_level=PREFECT_SERVER_LOGGING_LEVEL.value().lower(),
    )


if __name__ == "__main__":
    main()
