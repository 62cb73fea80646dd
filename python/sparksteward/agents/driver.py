"""The driver agent: one per application, started by the shim's DriverPlugin.

It owns the application's jobs and their results (JobResultStore), the BlobServer, and cleanup. The
user's Python driver reaches it through :class:`sparksteward.client.Steward`; executor agents reach
its BlobServer. Run as ``python -m sparksteward.agents.driver`` (the shim does this).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sparksteward.agents.base import Agent, run_agent

__all__ = ["DriverAgent"]

log = logging.getLogger("sparksteward.agent.driver")


class DriverAgent(Agent):
    """Driver-side agent. See the module docstring."""

    role = "driver"

    def __init__(self, hello: dict[str, Any], clock: Any = None) -> None:
        super().__init__(hello, clock)
        self.app_id: str | None = None

    def health_details(self) -> dict[str, Any]:
        return {"app_id": self.app_id}

    def on_app_start(self, msg: dict[str, Any]) -> None:
        self.app_id = msg["app_id"]
        log.info("application %s (%s) started", msg["app_id"], msg["app_name"])


if __name__ == "__main__":
    sys.exit(run_agent(DriverAgent))
