"""The workers' metrics directory (prometheus-client's multiprocess mode), kept to a
bounded number of files while every counter served from it never goes down.

Each process writes its series to files of its own, `<kind>_<pid>.db` (kind: counter,
histogram, summary, gauge_<mode>), and a scrape sums every file. Left alone, a restarted
worker's files stay forever (its counts must keep counting) and the directory grows by one
set per restart (issue 36: 676 files after 200 rolling restarts, a scrape 0.31 -> 0.60 s).
So the daemon *absorbs* a dead process: its values are merged into one archive per kind,
`<kind>_dead.db` (prometheus-client's own MmapedDict format, keys as the processes wrote
them, so a scrape merges the archive with the live files like any other file), and its
files are removed. Its live-mode gauges (gauge_live*) are only removed, as
prometheus-client's mark_process_dead does: they count live processes only.

Safe against a concurrent scrape and a crash, with two rules:
- The archive records which pids it has absorbed (bookkeeping keys, ABSORBED), and a
  reader skips the files of those pids. The writer writes the new archive under a
  temporary name, renames it over the old (atomic: a reader opens the old or the new,
  whole), and only then removes the absorbed pids' files. So every state of the directory
  counts each value once: before the rename the old archive does not hold them and their
  files do; after it the archive holds them and their files, present or not, are skipped.
  Once the files are gone, the archive is written once more without those pids (the same
  values): a pid the kernel gives to a new process later is that process's to count.
  A crash at any point leaves one of these states; the next absorb finds the leftover
  files of an absorbed pid and only removes them (idempotent, nothing counted twice).
- A scrape reads several files one after another, so it checks that the archives it read
  are those the directory still holds when it is done; if one was replaced meanwhile (or
  a file vanished under it), it reads again (`MetricsDirCollector`). Files vanish only
  after the archive that absorbed them was renamed in, so a read that saw no rename saw
  every file it needed.
A read is optimistic: nothing stops an absorb. Should absorbs keep coming faster than a
read takes (never seen: they come at the pace of worker deaths), the scrape takes a
shared flock on LOCK, which an absorb only ever tries (non-blocking): it then leaves the
files as they are, counted as before, for the next absorb. So the daemon never waits on a
scraper (one SIGSTOPped would stall its supervision), and a scrape never starves.

Kinds left as they are: gauge_all (a dead process's value stays, labelled by its pid, by
prometheus-client's definition; merging would lose that label; ours use livesum) and any
kind this module does not know.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

ARCHIVE = "dead"  # `<kind>_dead.db`: what the dead processes counted, merged
ABSORBED = "preload_metrics_absorbed_process"  # bookkeeping family in an archive: one key per absorbed pid
LOCK = ".lock"  # flock: shared by a scrape that met absorbs OPTIMISTIC times in a row; tried by an absorb
OPTIMISTIC = 5  # reads without the lock (one suffices unless the daemon absorbs meanwhile)
LOCK_WAIT = 5.0  # seconds a scrape waits for an absorb to finish (milliseconds, unless the daemon is stopped)


def combine(kind: str):
    """How two values of one key in files of `kind` merge into one, as prometheus-client's
    collector merges them across processes: (value, timestamp) pairs in, one out. None
    for a kind that is not merged into an archive."""
    if kind in ("counter", "histogram", "summary", "gauge_sum"):
        return lambda a, b: (a[0] + b[0], max(a[1], b[1]))
    if kind == "gauge_min":
        return min
    if kind == "gauge_max":
        return max
    if kind == "gauge_mostrecent":
        return lambda a, b: a if a[1] >= b[1] else b
    return None


def parse(name: str) -> tuple[str, int | str] | None:
    """`counter_123.db` -> ("counter", 123); `counter_dead.db` -> ("counter", "dead");
    None for anything else (a temporary file, a stranger)."""
    if not name.endswith(".db") or name.startswith("."):
        return None
    kind, _, owner = name[:-3].rpartition("_")
    if not kind:
        return None
    if owner.isdigit():
        return kind, int(owner)
    return (kind, owner) if owner == ARCHIVE else None


def owners(directory: Path) -> set[int]:
    """The pids that have files in `directory`."""
    return {p[1] for p in map(parse, os.listdir(directory)) if p and isinstance(p[1], int)}


def archive_path(directory: Path, kind: str) -> Path:
    return directory / f"{kind}_{ARCHIVE}.db"


def _absorbed_key(pid: int) -> str:
    return mmap_key(ABSORBED, ABSORBED, ["process"], [str(pid)], "pids merged into this archive (preload)")


def _read_archive(path: Path) -> tuple[dict[str, tuple[float, float]], set[int]]:
    """An archive's series {key: (value, timestamp)} and the pids it has absorbed."""
    values, absorbed = {}, set()
    try:
        entries = list(MmapedDict.read_all_values_from_file(str(path)))
    except FileNotFoundError:
        return values, absorbed
    for key, value, timestamp, _ in entries:
        name, _, labels, _ = json.loads(key)
        if name == ABSORBED:
            absorbed.add(int(labels["process"]))
        else:
            values[key] = (value, timestamp)
    return values, absorbed


def open_lock(directory: Path) -> int:
    return os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def absorb(directory: Path, dead: Iterable[int]) -> int:
    """Merge the files of the `dead` pids (exited: none writes any more) into the
    archives and remove them, their live-mode gauges removed without a merge. Returns the
    number of files removed: 0 too while a scrape holds the lock, or another absorb does
    (nothing done; the next call does it). The daemon calls this as it reaps."""
    fd = open_lock(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return 0
    try:
        return _absorb(directory, set(dead))
    finally:
        os.close(fd)


def _absorb(directory: Path, dead: set[int]) -> int:
    owned: dict[str, dict[int, Path]] = {}  # kind -> {pid: its file}
    archived = set()  # kinds with an archive
    for entry in os.scandir(directory):
        parsed = parse(entry.name)
        if parsed and parsed[1] == ARCHIVE:
            archived.add(parsed[0])
        elif parsed:
            owned.setdefault(parsed[0], {})[parsed[1]] = Path(entry.path)
    removed = 0
    for kind in sorted(owned.keys() | archived):
        files = owned.get(kind, {})
        gone = dead & files.keys()
        if kind.startswith("gauge_live"):  # counts live processes only: gone with the process
            removed += _unlink(files[pid] for pid in gone)
            continue
        merge = combine(kind)
        if merge is None or not (gone or kind in archived):
            continue
        path = archive_path(directory, kind)
        values, absorbed = _read_archive(path)
        new = gone - absorbed  # (the rest: a crash came between 1 and 2 below: counted already)
        if new:
            for pid in sorted(new):
                for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(str(files[pid])):
                    values[key] = merge(values[key], (value, timestamp)) if key in values else (value, timestamp)
            absorbed |= new
            _write_archive(path, values, absorbed)  # 1: the archive counts them, and a scrape skips their files
        removed += _unlink(files[pid] for pid in gone)  # 2: their files go
        # 3: the same values, skipping none whose files are gone: a pid used again by a new
        # process must be counted (a crash before this leaves them to the next absorb).
        still = absorbed & (files.keys() - gone)
        if still != absorbed:
            _write_archive(path, values, still)
    return removed


def _write_archive(path: Path, values: dict[str, tuple[float, float]], absorbed: set[int]) -> None:
    """`values` and the `absorbed` pids as the archive at `path`, replacing it at once.
    (No fsync: a crash of the daemon leaves the page cache intact; after a reboot no worker
    survives, and a daemon whose workers are all gone starts its metrics anew.)"""
    tmp = path.with_name(f".{path.name}.tmp")  # (no `.db`: never read by a scrape)
    tmp.unlink(missing_ok=True)  # a crash's: MmapedDict would carry its keys on
    out = MmapedDict(str(tmp))
    try:
        for key, (value, timestamp) in values.items():
            out.write_value(key, value, timestamp)
        for pid in sorted(absorbed):
            out.write_value(_absorbed_key(pid), 1.0, 0.0)
    finally:
        out.close()
    os.replace(tmp, path)


def _unlink(paths: Iterable[Path]) -> int:
    n = 0
    for p in paths:
        p.unlink(missing_ok=True)
        n += 1
    return n


class Moved(Exception):
    """The directory changed under a read: read it again."""


class MetricsDirCollector(Collector):
    """What prometheus-client's MultiProcessCollector collects from `directory`, read so
    that an absorb running meanwhile never makes a value count twice or go missing (the
    module's doc), without the bookkeeping."""

    def __init__(self, directory: str | Path):
        self.directory = str(directory)

    def collect(self) -> Iterator[Metric]:
        for _ in range(OPTIMISTIC):
            try:
                return self.served(self.read())
            except (Moved, FileNotFoundError):
                continue
        fd = open_lock(Path(self.directory))
        try:
            deadline = time.monotonic() + LOCK_WAIT
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the metrics in {self.directory} stay locked by an absorb") from None
                    time.sleep(0.005)
            return self.served(self.read())  # (no absorb now: it tries the lock)
        finally:
            os.close(fd)

    @staticmethod
    def served(families: Iterable[Metric]) -> Iterator[Metric]:
        return iter([f for f in families if f.name != ABSORBED])

    def read(self) -> Iterable[Metric]:
        held: dict[str, int] = {}  # archive name -> an fd on the one read (held: its inode cannot be reused)
        try:
            skip: dict[str, set[int]] = {}
            for name in os.listdir(self.directory):
                parsed = parse(name)
                if parsed and parsed[1] == ARCHIVE:
                    held[name] = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_CLOEXEC)
                    skip[parsed[0]] = _read_archive(Path(self.directory, name))[1]
            files = []
            for name in os.listdir(self.directory):
                parsed = parse(name)
                if parsed is None:
                    continue
                kind, owner = parsed
                if owner == ARCHIVE and name not in held:
                    raise Moved  # a first archive of its kind appeared: it may hold files listed here
                if owner not in skip.get(kind, ()):
                    files.append(os.path.join(self.directory, name))
            families = MultiProcessCollector.merge(files, accumulate=True)
            for name, fd in held.items():  # the archives read are still the directory's: no absorb came between
                if os.stat(os.path.join(self.directory, name)).st_ino != os.fstat(fd).st_ino:
                    raise Moved
            return families
        finally:
            for fd in held.values():
                os.close(fd)
