"""A child process that ends with its parent (Linux), however the parent ends.

``die_with_parent`` is safe between fork and exec (only a C call, nothing that takes a lock), so it
serves as a ``preexec_fn``; with ``parent_pid`` it also serves as a process pool's initializer,
where the parent may already be gone by the time the child runs it."""

from __future__ import annotations

import os
import signal

try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux: children outlive a parent killed by SIGKILL or SIGTERM
    _LIBC = None
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel for SIGTERM when this process's parent exits (even by SIGKILL). With
    ``parent_pid``, exit at once if that parent is already gone (it died before the request)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def child_pool(workers: int):
    """A pool of ``workers`` spawned processes that end with this one, however it ends: a run
    stopped with SIGTERM or SIGKILL leaves no worker training on (and holding its cell's lock)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=die_with_parent,
                               initargs=(os.getpid(),))
