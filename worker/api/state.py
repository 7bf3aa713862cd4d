"""The worker's phase, which /health reports: starting -> ready -> draining; and where
its weights come from, which /status reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    phase: str = "starting"
    started: float = field(default_factory=time.monotonic)
    # "attached" (the daemon's, zero-copy) or "in-process" (no daemon answered: serve's
    # fallback, a copy of the weights of its own); `weights_note` says which daemon, or why not.
    weights: str = "attached"
    weights_note: str = ""

    @property
    def serving(self) -> bool:
        return self.phase == "ready"
