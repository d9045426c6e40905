"""What a shared-memory wire slot leaves in this process and on the host (shared by the slot and HTTP tests)."""

from __future__ import annotations

import contextlib
import os


def memfd_slots() -> set[str]:
    """This process's open slot descriptors (their memfd names)."""
    names = set()
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{entry}")
            if target.startswith("/memfd:arctic-rl-slot-"):
                names.add(target)
    return names


def shm_files() -> set[str]:
    """Files under /dev/shm that name arctic (the slots must never create any)."""
    return {name for name in os.listdir("/dev/shm") if "arctic" in name} if os.path.isdir("/dev/shm") else set()
