"""Files the training writes beside others' (run directories, token files): whole or not at all."""
from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` as a new regular file, never through a symlink planted there: the bytes go to a fresh
    temporary file beside it (O_CREAT|O_EXCL|O_NOFOLLOW), which then replaces the name; a symlink at
    `path` is replaced, its target untouched. The run directory is writable by the training pods."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    tmp = f".{path.name}.{os.getpid()}.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=fd)
        try:
            os.write(out, data)
            os.fsync(out)
        finally:
            os.close(out)
        os.replace(tmp, path.name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=fd)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
