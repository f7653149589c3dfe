"""cuda_ipc's early Commit: the CUDA IPC event a sender's Commit names.

    sender                                   decoder (receiver)
    Hello(commit_event=handle)        ──▶    open it (once per handle) → Welcome(commit_event=True)
    writes queued on its copy stream
    event.record(copy stream)
    Commit(req, event=handle)         ──▶    event.synchronize(): the copies have landed
    wait for its own writes                  → the chunks become hits
                                      ◀──    Ok

The Commit's round trip runs beside the copies' tail instead of after it. A
receiver that cannot open the event (a buffer in CPU memory, the sender's
own process, a malformed handle) says so in its Welcome, and that sender
commits after its writes are done, as the other channels do. One event per
sender link: the sender records it again only after the Ok of the Commit
that named it, so the receiver never waits on a later request's record.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvtier.logs import get_logger
from kvtier.pd import protocol as proto

log = get_logger(__name__)

HANDLE_HEX = 128  # a cudaIpcEventHandle_t (64 bytes) as hex
# senders' events kept open; a Commit naming one dropped since fails (its sender reconnects)
MAX_OPEN = 256


def commit_event() -> tuple[torch.cuda.Event, str]:
    """An event on this process's current GPU for a sender's Commits, and its handle (hex)."""
    event = torch.cuda.Event(interprocess=True)
    return event, event.ipc_handle().hex()


class CommitEvents:
    """The commit events a receiver opened, by handle; `device` None: it opens none."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device if device is not None and device.type == "cuda" else None
        self._events: OrderedDict[str, torch.cuda.Event] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, handle: str) -> bool:
        """Open a sender's event (at its Hello); whether its Commits may name it."""
        if self.device is None or len(handle) != HANDLE_HEX:
            return False
        with self._lock:
            if handle in self._events:
                return True
        try:
            event = torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(handle))
        except (ValueError, RuntimeError) as exc:
            log.info(
                "PD receiver: a sender's commit event cannot be opened here (%s); its Commits come "
                "after its writes",
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return False
        with self._lock:
            self._events.setdefault(handle, event)
            while len(self._events) > MAX_OPEN:
                self._events.popitem(last=False)
        return True

    def wait(self, handle: str) -> None:
        """Return once the writes a Commit names are done: at once for "", else after its event."""
        if not handle:
            return
        with self._lock:
            event = self._events.get(handle)
        if event is None:
            raise proto.ProtocolError("Commit names an event its sender's Hello did not open here")
        try:
            event.synchronize()
        except (
            RuntimeError
        ) as exc:  # the sender's context is gone (it died): its writes cannot be trusted
            raise ConnectionError(f"the sender's commit event failed: {exc}") from None
