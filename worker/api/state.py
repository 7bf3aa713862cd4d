"""The worker's phase, which /health reports: starting -> ready -> draining."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)

    @property
    def serving(self) -> bool:
        return self.phase == "ready"
