"""``laminar serve``: the pipeline as a Prefect deployment on a cron schedule. No logic here.

The process that calls ``serve`` must have ``PREFECT_API_URL`` (a server with a scheduler) and
``PREFECT_HOME`` in its environment before it imports this module (``flows.cli.cmd_serve`` does it).
"""

from __future__ import annotations

from flows.pipeline import laminar_run


def serve(name: str, cron: str, parameters: dict, description: str) -> None:
    """Register deployment ``laminar-run/<name>`` with the schedule and run its flow runs until stopped
    (Ctrl-C or SIGTERM; the schedule is paused then). One run at a time: the workspace has one lock."""
    laminar_run.serve(
        name=name,
        cron=cron,
        parameters=parameters,
        description=description,
        tags=["laminar"],
        limit=1,
        pause_on_shutdown=True,
    )
