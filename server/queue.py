"""The engine's waiting line: up to `slots` sequences compute at a time (they step together,
engine.batch), the others wait in order.

A request takes a Ticket and joins; it holds one of the engine's slots when its ticket is
granted, and leaves when its run has ended (or it gave up). The line is bounded, in all and per client address (a
client's fair share), so a full line answers at once (429) instead of letting requests pile up.
While the line is held (an operator's preset change waiting for the engine to be idle) no slot is
granted; the waiting keep their places until it is released.
Everything here runs in the server's event loop: no locks.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message, self.code = message, code


def product_token(user_agent: str | None) -> str:
    """The first product token of a User-Agent header ("OpenAI/Python 1.2" -> "OpenAI/Python"),
    printable ASCII, at most 64 characters; "" if none."""
    words = (user_agent or "").split()
    word = words[0] if words else ""
    return "".join(c for c in word if 32 < ord(c) < 127)[:64]


@dataclass(eq=False)
class Ticket:
    kind: str                   # what waits: "run" (POST /runs), "chat.completion", "text_completion"
    client: str                 # the client's address
    joined_at: float = field(default_factory=time.monotonic)
    granted: asyncio.Future | None = None
    granted_at: float | None = None     # when it took a slot (time.monotonic())
    run_id: str | None = None   # the run it started, once it has
    run: object = None
    starting: bool = False      # its run is being started
    abandoned: bool = False     # the client left: its run, started or to come, is cancelled
    agent: str = ""             # the product token of the client's User-Agent ("" if none)
    max_tokens: int | None = None   # the tokens its run generates at most, as the request asked
    timing: object = None       # its times from arrival to the end (ds4f.server.events.Timing)

    def abandon(self) -> None:
        self.abandoned = True
        if self.run is not None and not self.run.finished:
            self.run.cancel()


class EngineQueue:
    def __init__(self, capacity: int, client_share: int, slots: int = 1):
        self.capacity = capacity
        self.client_share = client_share
        self.slots = slots
        self.holders: list[Ticket] = []
        self.waiting: deque[Ticket] = deque()
        self.closed = False
        self.held = False        # no slot granted while held (see hold())
        self.on_gone = None      # called with a waiting ticket that left before its turn
        self.on_free = None      # called when a holder left (after the slots it freed were granted)

    @property
    def holder(self) -> Ticket | None:
        """The ticket that has held the engine longest (None: no one holds it)."""
        return self.holders[0] if self.holders else None

    @property
    def full(self) -> bool:
        return len(self.holders) >= self.slots

    def join(self, ticket: Ticket) -> None:
        """Take the engine at once if it is free and nobody waits, else wait in line; QueueFull
        if the line is full, or holds this client's share already."""
        if self.closed:
            raise QueueFull("the server is shutting down", "shutting_down")
        ticket.granted = asyncio.get_running_loop().create_future()
        if not self.full and not self.waiting and not self.held:
            self._grant(ticket)
            return
        if len(self.waiting) >= self.capacity:
            raise QueueFull(f"the engine is busy and {len(self.waiting)} requests wait for it already "
                            f"(the queue holds {self.capacity})", "queue_full")
        mine = sum(1 for t in self.waiting if t.client == ticket.client)
        if mine >= self.client_share:
            raise QueueFull(f"{mine} of your requests wait for the engine already (each client may have "
                            f"{self.client_share} of the {self.capacity} places in the queue)", "client_share")
        self.waiting.append(ticket)

    def take_now(self, ticket: Ticket) -> bool:
        """Take a slot if one is free and nobody waits; False otherwise (nothing joined)."""
        if self.closed or self.full or self.waiting or self.held:
            return False
        ticket.granted = asyncio.get_running_loop().create_future()
        self._grant(ticket)
        return True

    async def wait(self, ticket: Ticket) -> None:
        """Until the ticket holds the engine; cancelled (the client left): out of the line."""
        try:
            await asyncio.shield(ticket.granted)
        except asyncio.CancelledError:
            self.leave(ticket)
            raise

    def position(self, ticket: Ticket) -> int | None:
        """0 while it holds the engine, 1.. while it waits, None once it left."""
        if ticket in self.holders:
            return 0
        for i, t in enumerate(self.waiting, 1):
            if t is ticket:
                return i
        return None

    def leave(self, ticket: Ticket) -> None:
        """The ticket's run ended or it gave up: the next in line gets its slot."""
        if ticket in self.holders:
            self.holders.remove(ticket)
            self._grant_waiting()
            if self.on_free is not None:
                self.on_free()
        elif ticket in self.waiting:
            self.waiting.remove(ticket)
            if self.on_gone is not None:
                self.on_gone(ticket)
        if ticket.granted is not None and not ticket.granted.done():
            ticket.granted.cancel()

    def hold(self) -> None:
        """Grant no slot until release(): the holders finish, the waiting keep their places."""
        self.held = True

    def release(self) -> None:
        self.held = False
        self._grant_waiting()

    def _grant_waiting(self) -> None:
        while self.waiting and not self.full and not self.held:
            self._grant(self.waiting.popleft())

    def close(self) -> None:
        """Refuse new tickets and turn the waiting ones away."""
        self.closed = True
        while self.waiting:
            t = self.waiting.popleft()
            if not t.granted.done():
                t.granted.set_exception(QueueFull("the server is shutting down", "shutting_down"))

    def _grant(self, ticket: Ticket) -> None:
        if not ticket.granted.done():   # done: it gave up (a cancelled future)
            ticket.granted_at = time.monotonic()
            self.holders.append(ticket)
            ticket.granted.set_result(True)

    def view(self) -> dict:
        now = time.monotonic()
        holder = self.holder
        return {"capacity": self.capacity, "client_share": self.client_share, "waiting": len(self.waiting),
                "slots": self.slots, "held": self.held,
                "active": None if holder is None else {"kind": holder.kind, "run_id": holder.run_id,
                                                       "held_s": now - holder.joined_at},
                "holding": [{"kind": t.kind, "run_id": t.run_id, "held_s": now - t.joined_at} for t in self.holders],
                "queued": [{"position": i, "kind": t.kind, "waited_s": now - t.joined_at}
                           for i, t in enumerate(self.waiting, 1)]}
