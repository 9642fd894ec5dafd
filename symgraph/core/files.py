"""Files by their identity: deleting only what this process created (files named by their
``(device, inode)`` identity and checked through one handle on their parent directory, what
every writer of symgraph — the output directory, the graph drawing — uses to clean up), and
input files pinned for a run (:class:`PinnedFile`: opened once, every read checked against
what was opened)."""
from __future__ import annotations

import errno
import os
import stat

__all__ = ["identity", "file_id", "remove_own", "special_file", "check_input_file", "inside", "model_file", "model_roots",
           "copy_regular", "PinnedFile", "pin_id"]


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


def model_roots(directory: str) -> tuple:
    """The real directories a model directory's files may resolve into: the directory itself
    and, for a Hugging Face cache snapshot (``<repo>/snapshots/<revision>``, whose files are
    links into ``<repo>/blobs``), that repository's ``blobs`` folder."""
    root = os.path.realpath(os.path.abspath(os.path.expanduser(str(directory))))
    parent = os.path.dirname(root)
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    return (root, blobs) if os.path.basename(parent) == "snapshots" and os.path.isdir(blobs) else (root,)


def inside(path: str, root: str) -> bool:
    """``path`` is ``root`` or below it (both real paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def model_file(directory: str, name: str, *, what: str = "file") -> str:
    """The real path of the file ``name`` that the model directory ``directory`` names (its
    config, a shard its index lists, a tokenizer file), refused unless it resolves, after
    links, inside the directory (:func:`model_roots`) and is a regular file: a model directory
    is a closed world, and nothing outside it is read or copied because it says so."""
    from ..errors import InputError
    shown = os.path.join(str(directory), name)
    if not name or "\0" in name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise InputError(f"{what} {name!r} named in {str(directory)!r} is not a plain name inside that "
                         "directory; expected the name of a file in the model directory (as save_pretrained "
                         "writes it)")
    roots = model_roots(directory)
    real = os.path.realpath(os.path.join(roots[0], name))
    if not any(inside(real, r) for r in roots):
        raise InputError(f"{what} {shown!r} points outside the model directory (to {real}); symgraph reads "
                         "only files inside a model directory; expected a regular file in it, not a link out "
                         "of it")
    if not os.path.exists(real):
        raise FileNotFoundError(f"{what} {shown!r} is not there{' (a broken link)' if os.path.islink(shown) else ''}; "
                                "expected every file the model directory names")
    kind = special_file(real) or ("a directory" if os.path.isdir(real) else None)
    if kind:
        raise InputError(f"{what} {shown!r} is {kind}, not a regular file; expected a regular file in the "
                         "model directory")
    return real


def copy_regular(src_real: str, dst: str) -> None:
    """Copy the regular file ``src_real`` (a path :func:`model_file` returned) to the new file
    ``dst``: opened without following a link at its last component and checked regular through
    its handle, so a file swapped for a link or a FIFO after the check is never read."""
    import shutil
    from ..errors import InputError
    try:
        fd = os.open(src_real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InputError(f"cannot copy {src_real!r} ({e.strerror}); expected a regular file") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InputError(f"{src_real!r} is not a regular file; expected a regular file to copy")
        with open(dst, "xb") as g:
            shutil.copyfileobj(f, g)


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


class PinnedFile:
    """An input file opened once for the run and pinned: its identity (device, inode, size,
    modification time) taken from the open handle, which stays open. :attr:`reader` is a path
    that opens the pinned file itself (``/proc/self/fd/N``), not whatever now has its name, so
    every read sees one version of it; :meth:`check` refuses, in one line, a file that was
    replaced (an atomic ``os.replace``, as ``save_pretrained`` writes), removed or rewritten in
    place since. Without a handle to spare (the process's file limit) the identity is taken
    from the path and checked the same way; reads then go through the path."""

    def __init__(self, path: str, what: str = "checkpoint file"):
        import weakref
        self.path, self.what, self.fd = path, what, None
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        self.id = pin_id(os.fstat(self.fd) if self.fd is not None else os.stat(path))
        if self.fd is not None:
            weakref.finalize(self, os.close, self.fd)
        proc = f"/proc/self/fd/{self.fd}"
        self.reader = proc if self.fd is not None and os.path.exists(proc) else path

    def check(self) -> None:
        """Refuse (InputError) unless ``path`` still names the pinned file, unchanged."""
        from ..errors import InputError
        how: str | None
        try:
            now = pin_id(os.stat(self.path))
        except OSError as e:
            how = f"it is gone: {e.strerror}"
        else:
            held = pin_id(os.fstat(self.fd)) if self.fd is not None else now
            how = (f"another file took its name: inode {self.id[1]} -> {now[1]}" if now[:2] != self.id[:2]
                   else None if now == self.id == held else "it was rewritten in place: size or modification "
                   f"time {self.id[2]}, {self.id[3]} -> {held[2]}, {held[3]}")
        if how is not None:
            raise InputError(f"{self.what} {self.path!r} changed during the run ({how}), so the tensors read "
                             "from it could mix two versions; nothing was written; expected inputs that stay "
                             "unchanged until symgraph ends (merge a copy of a checkpoint that is still being "
                             "saved)")


def pin_id(st) -> tuple:
    """What pins an input file: device, inode, size and modification time (ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
