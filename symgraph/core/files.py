"""Deleting only what this process created: files named by their ``(device, inode)``
identity and checked through one handle on their parent directory (what every writer of
symgraph — the output directory, the graph drawing — uses to clean up)."""
from __future__ import annotations

import os
import stat

__all__ = ["identity", "file_id", "remove_own", "special_file", "check_input_file"]


def check_input_file(path: str, what: str, expected: str) -> None:
    """Refuse, before opening it, an input file that is missing, a directory or not a regular
    file (a FIFO would block the read): ``"{what} {path!r} ...; expected {expected}"``."""
    from ..errors import InputError
    p = os.path.expanduser(str(path))
    if not os.path.exists(p):
        raise FileNotFoundError(f"{what} {path!r} does not exist; expected {expected}")
    if os.path.isdir(p):
        raise InputError(f"{what} {path!r} is a directory; expected {expected}")
    kind = special_file(p)
    if kind:
        raise InputError(f"{what} {path!r} is {kind}, not a regular file; expected {expected}")


def special_file(path: str) -> str | None:
    """What ``path`` is when it exists but is not a regular file (through links): "a FIFO",
    "a socket", "a character device"...; None for a regular file, a directory or nothing.
    Opening a FIFO blocks until a writer comes: inputs are checked with this first."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def file_id(st) -> tuple:
    """What identifies a file symgraph wrote: inode, size and modification time (a rename keeps
    them; replacing or rewriting the file changes them)."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def identity(path: str) -> tuple:
    """``(device, inode)`` of ``path`` itself (a link is not followed)."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def remove_own(path: str, ident: tuple, prefix: str, only=None) -> None:
    """Delete ``path`` only if it is still the very file or directory this process created:
    named with the (non-empty) temporary prefix it was made under, the same ``(device,
    inode)`` as ``ident`` (taken when it was made), and not a link. Whatever else now has that
    name, or a name never created here, stays. The check and the deletion go through one
    handle on the parent directory, so a parent swapped in between is not followed.

    A directory loses only plain files directly in it, and is removed only if that empties it
    (links, subdirectories and anything else stay, and so does the directory): every file of
    the directory when ``only`` is None (this call's own private temporary directory), else
    just the files ``only`` maps to their identity (:func:`written_files`) that still have it."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError("remove_own needs the temporary prefix the path was created under")
    parent, name = os.path.split(os.path.abspath(path))
    if not name.startswith(prefix):
        return
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != tuple(ident) or stat.S_ISLNK(st.st_mode):
            return
        if stat.S_ISDIR(st.st_mode):
            _remove_entries(name, pfd, only)
        else:
            os.unlink(name, dir_fd=pfd)
    finally:
        os.close(pfd)


def _remove_entries(name, pfd, only):
    """Unlink the plain files in directory ``name`` (of ``pfd``) — all of them, or those
    ``only`` maps to their current identity — then the directory if that emptied it."""
    try:
        dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=pfd)
    except OSError:
        return
    try:
        for entry in os.listdir(dfd) if only is None else only:
            try:
                st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and (only is None or file_id(st) == tuple(only[entry])):
                    os.unlink(entry, dir_fd=dfd)
            except OSError:
                pass
    finally:
        os.close(dfd)
    try:
        os.rmdir(name, dir_fd=pfd)
    except OSError:
        pass  # something else is in it: it stays
