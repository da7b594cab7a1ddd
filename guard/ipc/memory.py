"""Anonymous shared memory handed to a child process as a file descriptor.

Why memfd and not ``multiprocessing.shared_memory``: a named segment outlives a crash unless
someone unlinks it, and Python's resource tracker (before 3.13) unlinks segments that a child
merely attached to when that child exits, which breaks a verifier that restarts. A memfd has no
name: the serving process creates it, passes the descriptor to each verifier it starts
(``subprocess.Popen(pass_fds=...)``), and the kernel frees the memory when the last mapping and
descriptor are gone. Linux only, like guard's sidecar deployment.
"""

from __future__ import annotations

import mmap
import os


class SharedBlock:
    """``size`` bytes of zeroed shared memory; ``fd`` is what a child maps with ``attach``."""

    def __init__(self, size: int, fd: int | None = None, name: str = "guard"):
        self.size = size
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def attach(cls, fd: int, size: int) -> "SharedBlock":
        return cls(size, fd=fd)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a memoryview is still exported: the mapping goes with the process
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
