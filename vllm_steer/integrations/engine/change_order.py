"""The order of the changes to one name across data-parallel engine cores.

With data parallelism every engine core holds its own registry and preset table, and every
API server sends each change to every engine core over its own connection. Two changes of one
name sent at once by two API servers (``--api-server-count`` >= 2) can therefore reach the
engine cores in different orders, and each engine core would apply the last one it got: both
calls answered 200, the engine cores serving different files.

So each change is numbered first: the API server takes a ticket from engine core 0
(:meth:`ChangeOrder.ticket`, the ``ticket`` op), strictly increasing there, and sends it with
the change. Each engine core applies the changes of a name in ticket order: a change whose
ticket is older than one it has already taken for that name is refused (HTTP 409,
``superseded``; the newer change stands there). The newest change of a name is refused
nowhere, so the engine cores end on it; a change refused on some engine cores only is undone
on the others by the API server (as any change that only some engine cores took). A change
refused for what it is (HTTP 400: a bad file, a rank over the reservation, a bad mix), which
every engine core refuses alike, takes no ticket: it changed nothing anywhere, so an older
change of the name still applies everywhere. Without data parallelism changes carry no
ticket: the one engine core orders them as they come.
Light: standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_steer.integrations.protocol import ORDERED_OPS, TICKET_KEY


@dataclass
class ChangeOrder:
    """One engine core's tickets: the last it issued (engine core 0 issues them) and, per
    name, the newest it has taken."""

    issued: int = 0
    """The last ticket issued here (nanoseconds of the wall clock, or one more than the last:
    strictly increasing, and still above the last after the engine core restarts)."""
    taken: dict[tuple[str, str], int] = field(default_factory=dict)
    """``(kind, name)`` -> the newest ticket of a change of that name taken here."""

    def ticket(self) -> int:
        """A new ticket, above every one issued before."""
        self.issued = max(self.issued + 1, time.time_ns())
        return self.issued

    def refusal(self, op: str, kwargs: dict, engine: int) -> dict | None:
        """The answer refusing the change ``op`` ``kwargs`` here because a newer change of its
        name was taken first (409, ``superseded``), or the answer refusing a ticket that is
        no whole number (400); else None (then :meth:`take` once it is answered). A change
        without a ticket (one engine core; a first use) is never refused."""
        ticket = kwargs.get(TICKET_KEY)
        kind = ORDERED_OPS.get(op)
        if ticket is None or kind is None:
            return None
        if not isinstance(ticket, int) or isinstance(ticket, bool):
            return {"ok": False, "status": 400,
                    "error": f"steer management op {op!r}: {TICKET_KEY} must be a whole "
                             f"number, got {type(ticket).__name__}"}
        key = (kind, kwargs["name"])
        newest = self.taken.get(key, 0)
        if ticket < newest:
            return {"ok": False, "status": 409, "superseded": True,
                    "error": f"{kind} {kwargs['name']!r} was changed at the same time by "
                             f"another call, which reached engine core {engine} first: this "
                             f"{op.replace('_', ' ')} is not applied (the other change stands "
                             "on every engine core); send it again to apply it after"}
        return None

    def take(self, op: str, kwargs: dict, answer: dict) -> None:
        """The change ``op`` ``kwargs`` was answered ``answer`` here (not refused by
        :meth:`refusal`): its ticket is taken for its name, unless it was refused for what it
        is (HTTP 400), which every engine core refuses alike."""
        ticket = kwargs.get(TICKET_KEY)
        kind = ORDERED_OPS.get(op)
        if (kind is None or not isinstance(ticket, int) or isinstance(ticket, bool)
                or not isinstance(kwargs.get("name"), str)
                or (not answer.get("ok") and answer.get("status") == 400)):
            return
        key = (kind, kwargs["name"])
        self.taken[key] = max(self.taken.get(key, 0), ticket)
