"""The disk tier's budget, which holds for a directory, not for one engine.

The disk budget holds for the directory, not for one engine: eviction measures what the directory
holds (every identity's files, and temporary files of writes in progress), so engines sharing it keep
to the budget together. A temporary file whose writer died (kill -9) is removed when the directory is
measured. A directory deleted under a running engine is created again at the next write.
"""
from __future__ import annotations

import os

DEFAULT_DISK_BYTES = 2**30
STALE_TMP_S = 600.0  # a temporary file this old is a write that died (one block's write takes far less)
RESCAN_S = 1.0  # while writing, the directory's usage is measured again at least this often


def _writer_alive(pid: int) -> bool:
    """Is the process that named a temporary file still running (on this machine)?"""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process (PermissionError): alive
        return True
    return True


def stale_tmp(name: str, mtime: float, now: float) -> bool:
    """A temporary file `<name>.<pid>.<thread>.tmp` left by a write that will never finish: its
    process is gone (kill -9 mid-write), or it is older than STALE_TMP_S (another machine's, a pid
    reused)."""
    if now - mtime > STALE_TMP_S:
        return True
    parts = name.split(".")
    try:
        return not _writer_alive(int(parts[-3]))
    except (IndexError, ValueError):
        return False


def is_hex(name: str, n: int) -> bool:
    return len(name) == n and all(c in "0123456789abcdef" for c in name)
