"""What a run leaves beside ``--out`` when it is killed, and how the next run clears it.

Every temporary output directory holds, from the moment it is made, a run marker
(:data:`RUN_MARKER`) naming the run that made it: its process id, host, boot, the process's
start time, a random token, the directory's own name and the ``--out`` it was for. A run
killed outright (SIGKILL, the OOM killer) cannot remove its directory; the next run on the
same ``--out`` (:func:`sweep`) removes it when that run is dead — same host and boot, and its
process id no longer alive or now another process (another start time); or the host rebooted
since — and says so in one line on stderr. Anything else beside ``--out`` with the temporary
prefix (no marker, a run still alive, one on another host) is left alone and named. The
statistics a run spills beside ``--out`` carry a marker for no one output: the next run beside
them removes them once their run is dead.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import time

from ..core.files import identity, remove_own
from ..core.progress import note

#: The markers this process wrote: real directory -> the marker file's (device, inode).
_MARKED: dict = {}

__all__ = ["RUN_MARKER", "mark_run", "unmark_run", "sweep", "run_alive", "process_start"]

RUN_MARKER = ".symgraph-run.json"
_MARKER_LIMIT = 1 << 16  # bytes: a marker is a few hundred
_NAMED: set = set()  # what this process has named as left alone already


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, from ``/proc``), None where
    it cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of proc(5); the name and state precede the split
    except (OSError, IndexError, ValueError):
        return None


def _this_run(out: str | None, directory: str) -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot": _boot_id(), "start": process_start(pid),
            "token": secrets.token_hex(8), "created": time.time(), "dir": os.path.basename(directory),
            "out": out}


def mark_run(directory: str, out: str | None) -> None:
    """Write the run marker into the temporary ``directory`` (just made by this process) made
    for the output ``out`` (its absolute path; None: for no one output, e.g. statistics spilled
    beside it, which any run sweeping that directory's parent may remove once this run is dead)."""
    path = os.path.join(directory, RUN_MARKER)
    text = json.dumps(_this_run(out, directory))
    partial = path + ".partial"  # written whole, then named: a run killed meanwhile never leaves a half marker
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, path)  # the directory is this process's own, just made
    _MARKED[os.path.realpath(directory)] = identity(path)  # what unmark_run may remove


def unmark_run(directory: str) -> str:
    """Remove the run marker before ``directory`` (returned) becomes the output."""
    made = _MARKED.pop(os.path.realpath(directory), None)
    if made is not None:  # only the marker this process wrote there, whatever the name holds now
        remove_own(os.path.join(directory, RUN_MARKER), made, RUN_MARKER)
    return directory


def run_alive(marker: dict) -> bool | None:
    """Whether the run a marker names is alive: False when it is dead for sure (this host and
    boot, and its process gone or another process now; or this host booted again since), True
    when it still runs, None when this host cannot tell (another host, an unreadable marker)."""
    pid, start = marker.get("pid"), marker.get("start")
    if marker.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    boot = _boot_id()
    if boot is not None and marker.get("boot") is not None and marker.get("boot") != boot:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    now = process_start(pid)
    return not (isinstance(start, int) and now is not None and now != start)


def _read_marker(directory: str) -> dict | None:
    path = os.path.join(directory, RUN_MARKER)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        raw = f.read(_MARKER_LIMIT + 1)
    try:
        meta = json.loads(raw) if len(raw) <= _MARKER_LIMIT else None
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def sweep(out: str, prefix: str, *, aside: str | None = None, quiet: bool = False) -> list:
    """Remove the temporary directories (named ``prefix``...) that dead runs left beside the
    output ``out`` (an absolute path) and return what was removed; say so, and name what is left
    alone there, in one line each on stderr. This process's own directories are not touched.
    Directories named ``aside``... (a previous output moved aside by a run stopped in the
    instant it was replacing it) are named, never removed."""
    parent = os.path.dirname(out)
    try:
        names = sorted(n for n in os.listdir(parent) if n.startswith(prefix) or (aside and n.startswith(aside)))
    except OSError:
        return []
    removed, kept = [], []
    for name in names:
        path = os.path.join(parent, name)
        why = (_verdict(path, name, out) if name.startswith(prefix) else
               "a previous output moved aside by a run stopped while replacing it" if os.path.isdir(path) else None)
        if why == "dead":
            remove_own(path, identity(path), prefix)
            if os.path.lexists(path):
                kept.append(f"{path} (not empty after removing its files)")
            else:
                removed.append(path)
        elif why:
            kept.append(f"{path} ({why})")
    if removed and not quiet:
        note(f"removed {len(removed)} temporary director{'y' if len(removed) == 1 else 'ies'} "
             f"left beside --out by a killed symgraph run: {', '.join(removed)}")
    kept = [k for k in kept if k not in _NAMED]  # each named once per process
    _NAMED.update(kept)
    if kept and not quiet:
        note(f"left alone beside --out: {', '.join(kept)}; symgraph cannot tell that no run "
             "uses it: move or remove it yourself")
    return removed


def _verdict(path: str, name: str, out: str) -> str | None:
    """"dead" (a dead run's directory for ``out``: remove it), why it stays (named), or None
    (another output's, or this process's own: not ours to mention)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    marker = _read_marker(path)
    if marker is None:
        return "no run marker: symgraph cannot tell whose it is"
    if marker.get("out") not in (out, None):  # None: a run's spilled statistics, for no one --out
        return None
    if marker.get("pid") == os.getpid() and marker.get("start") == process_start(os.getpid()):
        return None  # this process's own, in use
    if marker.get("dir") != name or st.st_uid != os.geteuid():
        return "its run marker does not match it"
    alive = run_alive(marker)
    if alive is None:
        return f"made by a run on host {marker.get('host')!r}, which this host cannot check"
    return "dead" if alive is False else f"its run, process {marker.get('pid')}, is still running"
