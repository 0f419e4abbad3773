"""Facts about the host this process runs on, shared by the compiler and the runtime."""

from __future__ import annotations

import os


def physical_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
