"""Writing results without ever touching what is not ours.

``--out`` is vetted before any work (:func:`check_out`): its name must fit the file system
(each name at most ``NAME_MAX`` bytes, the path at most ``PATH_MAX``); it may not be a mount
point (the finished output is renamed into place, which a mount point cannot take), an input,
contain an input, be or contain the current directory, or be an existing directory that
symgraph did not write (a previous output carries the marker file :data:`MARKER`); its parent
must exist and be writable; and (:func:`check_space`, once the inputs' headers are read) its
file system must have room for the tensors the output will hold. The model is written to a
temporary sibling, marked as this run's (:mod:`~symgraph.checkpoints.leftovers`), and renamed
into place (:func:`save_atomic`); the temporary directory is removed on any failure, Ctrl-C or
SIGTERM (:func:`terminate_on_sigterm` turns SIGTERM into :class:`Terminated`), and a killed
run's is removed by the next run on the same ``--out``. New directories follow the umask like
any ``mkdir``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Callable

import torch

from ..core.files import copy_regular, file_id, identity, inside as _inside, model_file, remove_own  # noqa: F401 - remove_own re-exported
from ..errors import InputError
from .leftovers import RUN_MARKER, mark_run, sweep, unmark_run

__all__ = ["MARKER", "RECORDS", "record_of", "Terminated", "check_out", "check_new_file", "save_atomic",
           "terminate_on_sigterm", "model_card",
           "identity", "remove_own", "check_space", "human_bytes"]

MARKER = "symgraph_merge.json"
#: The record each command writes into its output (``merge``'s is :data:`MARKER`): any of them
#: marks a previous symgraph output.
RECORDS = (MARKER, "symgraph_align.json", "symgraph_apply.json", "symgraph_barrier.json", "symgraph_compare.json",
           "symgraph_demo.json", "symgraph_resize.json", "symgraph_rotate.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "spiece.model", "sentencepiece.bpe.model", "preprocessor_config.json")


class Terminated(BaseException):
    """SIGTERM arrived; raised in the main thread so that ``finally`` blocks clean up. A
    ``BaseException`` like ``KeyboardInterrupt``: no ``except Exception`` takes it for bad input."""


#: Outputs this process has put in place (the CLI says so when a signal arrives afterwards).
COMMITTED: list = []


class _signals_held:
    """SIGINT and SIGTERM held back around steps that must not be cut in two (moving the
    previous output aside and the new one into its place): a signal arriving inside is noted
    and acted on, as it would have been, on leaving. (A thread signal mask would not do: the
    process's other threads would still take the signal.) Outside the main thread: no-op."""

    def __enter__(self):
        self.got, self.old = [], {}
        try:
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, lambda n, f: self.got.append(n))
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)
        if self.got:
            sig, h = self.got[0], self.old[self.got[0]]
            if callable(h):
                h(sig, None)  # raises Terminated / KeyboardInterrupt as it would have
            elif h == signal.SIG_DFL:
                os.kill(os.getpid(), sig)
        return False


def terminate_on_sigterm():
    """Install a SIGTERM handler raising :class:`Terminated` (main thread only)."""
    def handler(signum, frame):
        raise Terminated("terminated by SIGTERM")
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave the default
        pass


def _real(p: str) -> str:
    return os.path.realpath(os.path.abspath(os.path.expanduser(p)))


def check_out(out: str, *, force: bool = False, inputs=()) -> str:
    """The absolute output path, refused (before any work) when writing it could lose data or
    could not end in place; a killed run's temporary directory beside it is removed (and said)."""
    path = _vet(out, force, inputs)[0]
    sweep(path, TMP_PREFIX, aside=OLD_PREFIX)
    return path


def check_space(out: str, need: int, what: str = "the merged model") -> None:
    """Refuse, in one line with human units, an output of ``need`` bytes that the free space
    of ``out``'s file system cannot hold (where the free space is known)."""
    try:
        free = shutil.disk_usage(os.path.dirname(out)).free
    except OSError:
        return
    if need > free:
        raise InputError(f"--out {out!r}: {what} needs {human_bytes(need)} but its file system has "
                         f"{human_bytes(free)} free; expected room for the output (free some space, or "
                         "choose an --out on another file system)")


def human_bytes(n: int) -> str:
    """``n`` bytes in decimal units: ``"1.2 GB"``, ``"300 MB"``, ``"512 B"``."""
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n} B"


def _check_name(out: str) -> None:
    """Refuse an ``--out`` whose names (or whole path, or temporary sibling's name) the file
    system cannot hold: found at the end otherwise, after all the work."""
    path = os.path.abspath(os.path.expanduser(out))
    parent = os.path.dirname(path)
    while parent != os.path.dirname(parent) and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    limits = []
    for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits.append(os.pathconf(parent, key))
        except (OSError, ValueError):
            limits.append(default)
    name_max, path_max = limits
    for name in path.split(os.sep) + [TMP_PREFIX + "x" * 8, OLD_PREFIX + "x" * 8]:
        size = len(os.fsencode(name))
        if size > name_max:
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise InputError(f"--out has a name of {size} bytes ({shown!r}); expected names of at most "
                             f"{name_max} bytes, as the file system holds them")
    if len(os.fsencode(path)) >= path_max:
        raise InputError(f"--out is a path of {len(os.fsencode(path))} bytes; expected a path shorter than "
                         f"{path_max} bytes, as the file system holds it")


def _vet(out, force, inputs) -> tuple:
    """:func:`check_out`'s path, and what symgraph wrote into it when it is a previous output
    (:func:`written_files`; empty otherwise): all that replacing it may delete."""
    owned = {}
    if not out or not str(out).strip():
        raise InputError("--out is empty; expected the path of a new output directory")
    _check_name(str(out))
    named = os.path.abspath(os.path.expanduser(str(out)))
    if os.path.islink(named):  # its target could be anywhere (dangling: a new directory there)
        raise InputError(f"--out {out!r} is a symbolic link (to {os.readlink(named)!r}); expected the path of a "
                         "directory itself, not a link to one")
    path = _real(str(out))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of --out {out!r} does not exist; expected an "
                                "existing directory to write into")
    cwd = _real(os.getcwd())
    if _inside(cwd, path):
        raise InputError(f"--out {out!r} is the current directory or contains it; expected a new "
                         "directory (e.g. --out merged)")
    for inp in inputs:
        if inp and os.path.exists(os.path.expanduser(str(inp))):
            real = _real(str(inp))
            if _inside(real, path):
                raise InputError(f"--out {out!r} is an input model ({inp!r}) or contains it; expected a "
                                 "directory apart from the inputs")
            if os.path.isdir(real) and _inside(path, real):
                raise InputError(f"--out {out!r} is inside the input directory {inp!r} (resolving links: "
                                 f"{real}); expected a directory apart from the inputs")
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise InputError(f"--out {out!r} exists and is not a directory; expected a new directory")
        if os.path.ismount(path):
            raise InputError(f"--out {out!r} is a mount point, and symgraph writes a new directory beside it and "
                             "renames that into place, which a mount point cannot take; expected a directory "
                             f"inside it (e.g. --out {os.path.join(str(out), 'merged')!r})")
        entries = os.listdir(path)
        if entries and record_of(entries) is None:
            raise InputError(f"output {out!r} already exists and was not written by symgraph (no "
                             f"{MARKER} or another symgraph_*.json record), so even --force will not replace "
                             "it; expected a new or empty directory, or a previous symgraph output")
        if entries and not force:
            raise InputError(f"output {out!r} already exists; pass --force to replace it, or choose a "
                             "new --out directory")
        owned = written_files(path) if entries else {}
        foreign = sorted(set(entries) - set(owned))
        if foreign:
            raise InputError(f"output {out!r} holds {_list(foreign)}, which symgraph did not write there "
                             f"or which changed since (its {record_of(entries)} lists what it wrote), so even "
                             "--force will not replace it; expected those moved out first, or a new "
                             "--out directory")
    try:  # a real probe: permission bits do not stop root, a read-only file system does
        os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=parent))
    except OSError as e:
        raise InputError(f"cannot write into {parent!r} ({e.strerror or e}); expected a writable "
                         "directory for --out") from None
    return path, owned


#: Temporary siblings of ``--out`` (short: a legal long ``--out`` name still leaves room).
TMP_PREFIX, OLD_PREFIX, PROBE_PREFIX = ".symgraph-tmp-", ".symgraph-old-", ".symgraph-probe-"


def check_new_file(path: str, option: str, inputs=()) -> str:
    """The absolute path of a single output file (``analyze --dot FILE``), refused before any
    work when writing it could lose data or change an input: it exists already (symgraph never
    replaces a file it did not write; a file keeps no record of who wrote it), its directory is
    missing, or it lies inside an input (through links too)."""
    if not path or not str(path).strip():
        raise InputError(f"{option} is empty; expected the path of a new file")
    real = _real(str(path))
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the directory of {option} {path!r} does not exist; expected an existing "
                                "directory")
    if os.path.lexists(real) or os.path.lexists(os.path.abspath(os.path.expanduser(str(path)))):
        raise InputError(f"{option} {path!r} already exists, and symgraph never replaces a file it did not "
                         "write; expected a new file name (or remove the old file first)")
    for inp in inputs:
        if inp and os.path.exists(os.path.expanduser(str(inp))) and _inside(real, _real(str(inp))):
            raise InputError(f"{option} {path!r} is inside the input {inp!r}; expected a path apart from the "
                             "inputs")
    return real


def _umask_mode(base=0o777):
    mask = os.umask(0)
    os.umask(mask)
    return base & ~mask


def save_atomic(model, out: str, *, force: bool = False, inputs=(), tokenizer_from=None,
                meta: dict | None = None, card: str | Callable[[], str] | None = None,
                record: str = MARKER) -> str:
    """``save_pretrained`` into a temporary sibling of ``out``, then rename it into place
    (``model`` may also be a function writing a checkpoint into the directory it is given).

    Writes ``record`` (one of :data:`RECORDS`, the command's own: ``meta`` as JSON, once the
    weights are written) and, with ``card``
    (or a function returning it, called then), a README.md. Replaces an
    existing ``out`` only when :func:`check_out` allows it (``force``, and it is a previous
    symgraph output or empty). The temporary directory never outlives the call.
    """
    out = check_out(out, force=force, inputs=inputs)
    parent = os.path.dirname(out)
    tmp_prefix, old_prefix = TMP_PREFIX, OLD_PREFIX
    tmp, made = _new_tmp(parent, out)  # what this call created (or moved aside): all it may delete
    old, owned = None, ()
    try:  # mkdtemp's 0700 until the rename: nobody else can add entries while it is written
        try:
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(tmp, safe_serialization=True)
            else:  # a writer: ``model(directory)`` writes the weights (out-of-core merging)
                model(tmp)
        except Exception as e:  # a full disk, a quota, an I/O error (OSError or safetensors' own)
            if not isinstance(e, OSError) and "safetensor" not in type(e).__name__.lower():
                raise
            raise InputError(f"writing the merged model into {parent!r} failed ({_short(e)}); nothing was "
                             "written; expected enough free space and a writable directory for --out") from None
        if tokenizer_from and os.path.isdir(tokenizer_from):
            for fn in TOKENIZER_FILES:  # regular files inside the model directory only, never a link out
                if os.path.lexists(os.path.join(tokenizer_from, fn)):
                    copy_regular(model_file(tokenizer_from, fn, what="tokenizer file"), os.path.join(tmp, fn))
        if card is not None:
            with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
                f.write(card() if callable(card) else card)
        written = sorted(set(os.listdir(tmp)) - {RUN_MARKER})  # what a later --force may delete, and how to know it
        ids = {n: list(file_id(os.lstat(os.path.join(tmp, n)))) for n in written}
        assert record in RECORDS, record
        with open(os.path.join(tmp, record), "w") as f:
            json.dump({**_jsonable(meta or {}), "files": written + [record], "file_ids": ids}, f, indent=2)
        os.chmod(tmp, _umask_mode())
        with _signals_held():  # the previous output moved aside and the new one in place: never half
            if os.path.lexists(out):
                owned = _vet(out, force, inputs)[1]  # still ours, right before replacing it
                old = tempfile.mkdtemp(prefix=old_prefix, dir=parent)
                os.rmdir(old)
                os.replace(out, old)
                made[old] = identity(old)
            os.replace(unmark_run(tmp), out)
            COMMITTED.append(out)
            if old is not None:
                remove_own(old, made[old], old_prefix, only=owned)
    finally:
        # the only deletions: ``tmp`` (this call's mkdtemp, a random sibling name) and ``old``
        # (the previous output, vetted by check_out as symgraph's own just before the move,
        # removed in the swap above once the new output is in place)
        remove_own(tmp, made[tmp], tmp_prefix)
        if old is not None and not os.path.lexists(out) and os.path.isdir(old):
            os.replace(old, out)  # the new output never arrived: put the previous one back
    return out


def _new_tmp(parent: str, out: str) -> tuple:
    """A new private temporary directory in ``parent`` for the output ``out``, marked as this
    run's (:func:`~symgraph.checkpoints.leftovers.mark_run`: should this process be killed, the
    next run on ``out`` knows whose it is), and ``{it: its identity}``."""
    tmp = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
    made = {tmp: identity(tmp)}
    try:
        mark_run(tmp, out)
    except BaseException:
        remove_own(tmp, made[tmp], TMP_PREFIX)
        raise
    return tmp, made


def _short(e) -> str:
    return (getattr(e, "strerror", None) or str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]


def written_files(out: str) -> dict:
    """The plain files symgraph wrote into its previous output ``out`` and still unchanged there,
    ``{name: identity}`` (:func:`_file_id`): the ``files`` its :data:`MARKER` lists with the
    identities it recorded, and the marker itself when it reads as symgraph's (a JSON object).
    A file replaced or rewritten since is not in it, so it is never deleted."""
    try:
        name = record_of(os.listdir(out)) or MARKER
    except OSError:
        return {}
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            st, meta = os.fstat(f.fileno()), json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(meta, dict) or not stat.S_ISREG(st.st_mode) or os.path.islink(path):
        return {}
    own = {name: file_id(st)}
    files, ids = meta.get("files"), meta.get("file_ids")
    if isinstance(files, list) and isinstance(ids, dict):
        for n in files:
            got = ids.get(n) if isinstance(n, str) and n == os.path.basename(n) else None
            try:
                now = os.lstat(os.path.join(out, n)) if got else None
            except OSError:
                now = None
            if now is not None and stat.S_ISREG(now.st_mode) and list(file_id(now)) == got:
                own[n] = tuple(got)
    return own


def record_of(entries) -> str | None:
    """The symgraph record among a directory's ``entries`` (the first of :data:`RECORDS`), or None."""
    return next((r for r in RECORDS if r in entries), None)


def _list(names, k=5):
    return ", ".join(repr(n) for n in names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def model_card(config_yaml: str, summary: str) -> str:
    """A README.md for a merged model: how to reproduce it and what the alignment did."""
    return ("# Merged with symgraph\n\n"
            "Reproduce with `symgraph merge --config merge.yaml`, where `merge.yaml` is:\n\n"
            f"```yaml\n{config_yaml.rstrip()}\n```\n\n## Alignment\n\n{summary.rstrip()}\n")


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
