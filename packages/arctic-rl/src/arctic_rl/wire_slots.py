"""The same-host fast path of the HTTP transport: large wire messages travel through shared memory, not the body.

A batch of a GiB posted as an HTTP body crosses the ASGI server in 64 KiB chunks through Python; through shared
memory it is written once by the client and read in place by the server. The exchange:

1. The client asks for an upload slot: ``POST /v1/wire_slots {"size": N}`` (N, the blob's exact size, at most the
   server's request-size limit). The server creates an anonymous shared-memory file (``memfd_create``, a random name
   ``arctic-rl-slot-<32 hex digits>``, sealed against growing and shrinking), writes a random nonce at its start, and
   answers the slot's name and the path through which its own process exposes it (``/proc/<pid>/fd/<fd>``). The
   nonce is never sent over HTTP.
2. The client opens that path, checks that it is the named slot of the announced size, reads the nonce back (which
   proves the file is visible to it, i.e. both run on this host as the same user), writes the message's safetensors
   blob into it (one copy of each tensor's bytes) and closes it.
3. The client posts the operation with ``Content-Type: application/vnd.arctic-rl.slot+json`` and the body
   ``{"slot": name, "nonce": hex, "size": N}``. The server looks the name up among its own slots (it never opens a
   path a request names), compares the nonce in constant time, seals the file against writes (refused while any
   writable mapping of it exists), maps it copy-on-write and decodes the message in place with every check of the
   body path (:func:`arctic_rl.wire.decode_message_view`). A slot is used once.

Bounds: every open slot holds a file descriptor and memory until it is used or expires, so the server keeps at most
``max_open_slots`` (64) open, at most ``max_slots_per_client`` (16) for one client address, and at most
``max_open_bytes`` (twice the request limit) in all; beyond any of them a request gets 429 with ``Retry-After`` (the
seconds until the client's, or anyone's, oldest slot expires), and the client sends that batch as the body.

Security: only processes of the server's user (or root) can open another process's ``/proc/<pid>/fd`` entry, so a
slot is no more exposed than a mode-0600 file; after the write seal nobody can change the bytes the server checked;
the size seals keep a client from truncating the file under the server's mapping. Nothing is left behind: a slot
lives in memory only (no name in any directory), the server closes slots that were not used within their lifetime
and all of them at shutdown, and the kernel frees them if the server dies. The client falls back to the HTTP body
(and keeps doing so) when the server is on another host, the server lacks the fast path or turned it off
(``--no-shared-memory``), or the handshake fails; ``http.shared_memory=False`` turns it off on the client.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import mmap
import os
import re
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from arctic_rl.errors import WireFormatError
from arctic_rl.wire import MessagePlan, decode_message_view

__all__ = [
    "SLOTS_PATH",
    "SLOT_CONTENT_TYPE",
    "SlotRegistry",
    "SlotUnavailable",
    "SlotUnusable",
    "write_to_slot",
]

SLOTS_PATH = "/wire_slots"
SLOT_CONTENT_TYPE = "application/vnd.arctic-rl.slot+json"
_NAME_PATTERN = re.compile(r"arctic-rl-slot-[0-9a-f]{32}")
_NONCE_PATTERN = re.compile(r"[0-9a-f]{32}")
_PATH_PATTERN = re.compile(r"/proc/[0-9]+/fd/[0-9]+")
_NONCE_BYTES = 16
# Smallest slot: a safetensors blob has at least its 8-byte header length (and the nonce must fit).
_MIN_SLOT_BYTES = _NONCE_BYTES


class SlotUnavailable(Exception):
    """The server cannot give a slot now; ``status`` is the HTTP status to answer, ``message`` says why, and
    ``retry_after_s`` (for 429) when a slot may be free again."""

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


class SlotUnusable(Exception):
    """This client cannot use the server's slot (another host, another user, or not the announced file)."""


@dataclass
class _Slot:
    fd: int
    size: int
    nonce: bytes
    expires: float
    client: str


class SlotRegistry:
    """The server's upload slots: created on request, used once, closed when used, expired or at shutdown.

    ``max_slot_bytes`` is the request-size limit; at most ``max_open_bytes`` of slots, ``max_open_slots`` slots,
    and ``max_slots_per_client`` slots of one client address are open at once (beyond any of them a request gets
    429 and the client sends the body instead).
    """

    def __init__(
        self,
        max_slot_bytes: int,
        *,
        lifetime_s: float = 120.0,
        max_open_bytes: int | None = None,
        max_open_slots: int = 64,
        max_slots_per_client: int = 16,
    ) -> None:
        self.max_slot_bytes = max_slot_bytes
        self.lifetime_s = lifetime_s
        self.max_open_bytes = 2 * max_slot_bytes if max_open_bytes is None else max_open_bytes
        self.max_open_slots = max_open_slots
        self.max_slots_per_client = max_slots_per_client
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self.created = 0
        self.used = 0

    def snapshot(self) -> dict[str, int]:
        """Slots open now, created and used (decoded) since the start: for ``/v1/status``."""
        with self._lock:
            return {"open": len(self._slots), "created": self.created, "used": self.used}

    def create(self, size: Any, client: str = "") -> dict[str, Any]:
        """A new slot of exactly ``size`` bytes for the client at address ``client``: ``{"slot", "path", "size",
        "expires_in_s"}`` (the JSON answer)."""
        if type(size) is not int or size < _MIN_SLOT_BYTES:
            raise SlotUnavailable(
                400, f"a slot's size must be an integer of at least {_MIN_SLOT_BYTES} bytes, got {size!r}."
            )
        if size > self.max_slot_bytes:
            raise SlotUnavailable(
                413,
                f"a slot of {size} bytes is more than this server's request limit of {self.max_slot_bytes}; split "
                "the batch, or restart the server with a larger --max-request-mb.",
            )
        if not hasattr(os, "memfd_create"):
            raise SlotUnavailable(501, "this server's platform has no memfd_create; send the batch as the body.")
        self.expire()
        with self._lock:
            self._check_room(size, client)
            name = f"arctic-rl-slot-{secrets.token_hex(16)}"
            nonce = secrets.token_bytes(_NONCE_BYTES)
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                import fcntl  # the server side only, on Linux (as memfd_create); clients import this module anywhere

                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
                os.pwrite(fd, nonce, 0)
            except OSError as error:
                os.close(fd)
                raise SlotUnavailable(503, f"the server could not create a slot ({error}); send the body.") from None
            self.created += 1
            self._slots[name] = _Slot(
                fd=fd, size=size, nonce=nonce, expires=time.monotonic() + self.lifetime_s, client=client
            )
        return {"slot": name, "path": f"/proc/{os.getpid()}/fd/{fd}", "size": size, "expires_in_s": self.lifetime_s}

    def _check_room(self, size: int, client: str) -> None:
        """Raise 429 when one more slot of ``size`` bytes for ``client`` would pass a bound (under the lock)."""
        open_slots = list(self._slots.values())
        own = [slot for slot in open_slots if slot.client == client]
        open_bytes = sum(slot.size for slot in open_slots)
        if len(own) >= self.max_slots_per_client:
            problem, waiting = f"this client has {len(own)} unused slots open, the most one client may hold", own
        elif len(open_slots) >= self.max_open_slots:
            problem, waiting = f"{len(open_slots)} slots are open, the most this server holds", open_slots
        elif open_bytes + size > self.max_open_bytes:
            problem = f"{open_bytes} bytes of slots are open, and {size} more would pass {self.max_open_bytes}"
            waiting = open_slots
        else:
            return
        retry_after_s = max(0.0, min(slot.expires for slot in waiting) - time.monotonic()) if waiting else 0.0
        raise SlotUnavailable(
            429,
            f"{problem}; send the batch as the body, or retry once pending uploads are done (an unused slot closes "
            f"after {self.lifetime_s:g} s).",
            retry_after_s=retry_after_s,
        )

    def take_message(self, body: bytes, max_bytes: int) -> Any:
        """The message in the slot that the request ``body`` (``{"slot", "nonce", "size"}``) names; the slot is
        closed whatever happens. Raises ``WireFormatError`` (400) for an unknown, expired, wrong or malformed one."""
        reference = _parse_reference(body)
        with self._lock:
            slot = self._slots.pop(reference["slot"], None)
        if slot is None:
            raise WireFormatError(
                f"there is no open slot named {reference['slot']!r} (unknown, used already, or expired after "
                f"{self.lifetime_s:.0f} s); request a new one from {SLOTS_PATH}, or send the batch as the body."
            )
        try:
            if not hmac.compare_digest(reference["nonce"], slot.nonce.hex()):
                raise WireFormatError(
                    f"the nonce for slot {reference['slot']!r} does not match the one in the slot; read it from the "
                    "slot's first bytes before writing the message."
                )
            if reference["size"] != slot.size:
                raise WireFormatError(
                    f"the request says {reference['size']} bytes, slot {reference['slot']!r} has {slot.size}; request "
                    "a slot of the message's exact size."
                )
            try:
                import fcntl

                fcntl.fcntl(slot.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            except OSError:
                raise WireFormatError(
                    f"slot {reference['slot']!r} is still mapped writable by another process; unmap and close it "
                    "before posting the request."
                ) from None
            # Copy-on-write: the server may change the decoded tensors in place without touching the sealed slot.
            mapping = mmap.mmap(slot.fd, slot.size, access=mmap.ACCESS_COPY)
        finally:
            os.close(slot.fd)
        message = decode_message_view(mapping, max_bytes=max_bytes)
        with self._lock:
            self.used += 1
        return message

    def expire(self) -> int:
        """Close the slots whose lifetime ended; how many."""
        now = time.monotonic()
        with self._lock:
            names = [name for name, slot in self._slots.items() if slot.expires <= now]
            for name in names:
                os.close(self._slots.pop(name).fd)
        return len(names)

    def close(self) -> None:
        """Close every open slot (at shutdown)."""
        with self._lock:
            for slot in self._slots.values():
                with contextlib.suppress(OSError):
                    os.close(slot.fd)
            self._slots.clear()


def _parse_reference(body: bytes) -> dict[str, Any]:
    try:
        reference = json.loads(body)
    except (ValueError, RecursionError):
        reference = None
    if (
        not isinstance(reference, dict)
        or set(reference) != {"slot", "nonce", "size"}
        or not isinstance(reference["slot"], str)
        or not isinstance(reference["nonce"], str)
        or _NONCE_PATTERN.fullmatch(reference["nonce"]) is None
        or type(reference["size"]) is not int
    ):
        raise WireFormatError(
            f'a {SLOT_CONTENT_TYPE} body is the JSON object {{"slot": <name>, "nonce": <32 hex digits>, "size": '
            "<int>}; send that, or the batch itself as the body."
        )
    return reference


def write_to_slot(answer: Any, plan: MessagePlan) -> str:
    """Client side: write ``plan``'s blob into the slot of the server's ``answer``; the request body naming it.

    Raises ``SlotUnusable`` when the slot is not reachable from this process as announced (the server runs on
    another host or as another user, or the path is not the named slot); the caller then sends the body.
    """
    if not isinstance(answer, dict):
        raise SlotUnusable(f"the slot answer is not a JSON object: {answer!r}")
    name, path, size = answer.get("slot"), answer.get("path"), answer.get("size")
    if not (
        isinstance(name, str)
        and _NAME_PATTERN.fullmatch(name)
        and isinstance(path, str)
        and _PATH_PATTERN.fullmatch(path)
        and size == plan.size
    ):
        raise SlotUnusable(f"the slot answer {answer!r} does not name a slot of {plan.size} bytes")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        raise SlotUnusable(f"cannot open the slot {path} ({error.strerror})") from None
    try:
        # The path is a number in another process's table: check it is the named slot before writing to it.
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{name} (deleted)":
            raise SlotUnusable(f"{path} is not the slot {name}")
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_size != plan.size:
            raise SlotUnusable(f"the slot {name} is not a file of {plan.size} bytes")
        nonce = os.pread(fd, _NONCE_BYTES, 0)
        try:
            plan.write_to_file(fd)
        except OSError as error:
            # E.g. shared memory full: the body still works (the server closes the slot when it expires).
            raise SlotUnusable(f"writing into the slot {name} failed ({error.strerror})") from None
    finally:
        os.close(fd)
    return json.dumps({"slot": name, "nonce": nonce.hex(), "size": plan.size})
