"""A test's client of the Prefect API ``laminar serve`` runs: its auth string from the workspace
(``tasks.serving.auth_file``) and, for the calls that change state, a CSRF token, as Prefect's own
client sends them."""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path

from core.workspace import Workspace
from tasks.serving import read_api_auth


class ServedAPI:
    def __init__(self, url: str, ws: Path | Workspace):
        self.url = url.rstrip("/")
        ws = ws if isinstance(ws, Workspace) else Workspace.at(ws)
        auth = read_api_auth(ws)
        assert auth, f"no auth string in {ws.prefect_home}"
        self.auth = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
        self.client = str(uuid.uuid4())
        self._csrf: str | None = None

    def csrf(self) -> dict:
        import httpx

        if self._csrf is None:
            r = httpx.get(
                f"{self.url}/csrf-token", params={"client": self.client}, headers=self.auth, timeout=30
            )
            r.raise_for_status()
            self._csrf = r.json()["token"]
        return {"Prefect-Csrf-Token": self._csrf, "Prefect-Csrf-Client": self.client}

    def call(self, path: str, body: dict | None = None, method: str = "POST"):
        """One authenticated call; a 503 (the server's database busy while a served run starts up) is
        retried a few times, any other error fails."""
        import httpx

        headers = {**self.auth, **(self.csrf() if method in ("POST", "PUT", "PATCH", "DELETE") else {})}
        for attempt in range(10):
            r = httpx.request(method, self.url + path, json=body, headers=headers, timeout=30)
            if r.status_code != 503 or attempt == 9:
                break
            time.sleep(2)
        r.raise_for_status()
        return r.json()
