"""What the daemon's /status says (and `preload status` prints): the weights it holds, a
copy per data-parallel rank, its workers and spares, its keeper, load and sleep."""

from __future__ import annotations

import os
import time


def daemon_status(d) -> dict:
    """`d`: the Daemon (preloadd/daemon.py)."""
    o, r = d.opts, d.r
    sup = d.supervisor.status() if d.supervisor else {}
    return {
        "state": d.state,
        "error": d.error,
        "pid": os.getpid(),
        "model": str(r.model),
        "quant": o.quant,
        "dtype": r.dtype,
        "device": r.device,
        "data_parallel": [{"dp_rank": k, "device": device, "bytes": copy.arena.size if copy else 0}
                          for k, (device, copy) in enumerate(zip(r.devices, d.copies or [None] * len(r.devices)))],
        "transport": r.transport,
        "state_dir": str(o.state_dir),
        "bytes_per_device": d._bytes_per_device(),
        "fingerprint": d.copies[0].manifest.fingerprint if d.copies else None,
        "readopted": d.readopted,
        "keeper_pid": d.keeper.pid if d.keeper and not d.keeper.empty else None,
        "attached_workers": d.attached(),
        "uptime_s": round(time.time() - d.started, 3),
        "load_seconds": d.progress.seconds,
        "progress": d.progress.as_dict(),
        "errors": d.errors,
        "sleep": d.sleeper.status(),
        "workers": sup.get("workers", []),
        "spares": sup.get("spares", []),
        "zygote_restarts": sup.get("zygote_restarts", 0),
        "restore": d.early_zygote.restore if d.early_zygote else None,  # (--restore: snapshot.py)
        "health_port": d.ports.get("health"),
        "port": d.ports.get("api"),
    }
