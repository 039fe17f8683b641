"""Connections that send a whole request head and then trickle its body, from many loopback
addresses (Linux routes all of 127.0.0.0/8 to lo: each client socket is bound to its own 127.0.0.N),
past the server's bounds on connections per address and in all, reconnecting as they are closed:
a request from 127.0.0.1 meanwhile is served, the oldest waiting bodies closed to make room with a
408 naming the body. Real sockets against a real `ds4f serve` on loopback, with small bounds so
that tens of sockets do what hundreds do against the defaults."""
from __future__ import annotations

import select
import socket
import threading
import time

from ds4f.server.options import ServerOptions

from server_helpers import connect_from, read_all, serve_config, start  # noqa: F401 (fixtures)

ADDRESSES = [f"127.0.0.{i}" for i in range(2, 8)]
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 4000\r\n\r\n{\"messages\": [")


def closed_by_server(s: socket.socket) -> bool:
    ready, _, _ = select.select([s], [], [], 0)
    return bool(ready)


def heads_taken(srv, address: str) -> int:
    """The server's connections from `address` whose request head it has read."""
    return sum(1 for p in list(srv.server.uvicorn.config.http.live) if p._address == address and p.cycle is not None)


def wait_for_head(srv, address: str, count: int) -> None:
    """Until the server has read `count` request heads from `address` (the event loop takes a new
    connection's head in a later turn than its accept: a connection dropped before that has sent
    nothing the server read, and is closed without an answer)."""
    deadline = time.monotonic() + 30
    while heads_taken(srv, address) < count:
        assert time.monotonic() < deadline, f"the server did not take {count} heads from {address}"
        time.sleep(0.01)


class Trickler:
    """`per_address` connections from each address, each with a whole head and a body that comes a
    byte every 0.1 s; a connection the server closes is read (its answer kept) and replaced.
    settled(address, count), for the first `room` connections: waits until the server has read the
    head of each (so that they, the oldest, are bodies coming when the later ones need room)."""

    def __init__(self, port: int, per_address: int, settled=None, room: int = 0) -> None:
        self.port = port
        self.open: list[tuple[int, str, socket.socket]] = []
        self.answers: list[tuple[int, bytes]] = []       # (the connection's number, what it got)
        self.opened = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        for _ in range(per_address):
            for address in ADDRESSES:
                self._connect(address)
                if settled is not None and self.opened <= room:
                    settled(address, sum(1 for _, a, _ in self.open if a == address))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _connect(self, address: str) -> None:
        s = connect_from(address, self.port)
        s.sendall(HEAD)
        with self.lock:
            self.open.append((self.opened, address, s))
            self.opened += 1

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            with self.lock:
                live = list(self.open)
            for n, address, s in live:
                if closed_by_server(s):
                    with self.lock:
                        self.open.remove((n, address, s))
                        self.answers.append((n, read_all(s)))
                    s.close()
                    self._connect(address)                # the attacker reconnects at once
                    continue
                try:
                    s.send(b" ")
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for _, _, s in self.open:
            s.close()


def test_trickled_bodies_from_many_addresses_never_shut_out_a_local_client(start):
    srv = start(max_client_connections=6, max_connections=24, header_timeout_s=60, body_timeout_s=60)
    attack = Trickler(srv.port, per_address=5,          # 30 bodies coming, from 6 addresses: past the 24 in all
                      settled=lambda address, count: wait_for_head(srv, address, count), room=24)
    try:
        for _ in range(3):                               # a local client, meanwhile, again and again
            assert srv.get("/health").status == 200
            chat = srv.chat(max_tokens=2, temperature=0)
            assert chat.status == 200, chat.body
        with attack.lock:
            answers = list(attack.answers)
    finally:
        attack.close()
    assert answers, "no trickled body was closed to make room"
    # each closed with a 408 naming the body (or reset: its next byte crossed the close, and the
    # kernel drops what the server had sent)
    said = [a for _, a in answers if a]
    assert said and all(a.startswith(b"HTTP/1.1 408 ") and b"body:" in a for a in said), {a[:60] for a in said}
    first = sorted(n for n, _ in answers)[:6]
    assert first == list(range(len(first))), first       # the oldest went first
    assert srv.service.runs_started == 3
    assert srv.get("/health").status == 200


def test_one_address_trickling_bodies_past_its_own_bound_closes_its_oldest(start):
    srv = start(max_client_connections=4, header_timeout_s=60, body_timeout_s=60)
    hogs = []
    for _ in range(4):
        s = connect_from("127.0.0.9", srv.port)
        s.sendall(HEAD)
        hogs.append(s)
    wait_for_head(srv, "127.0.0.9", 4)                  # every head taken: their bodies are awaited
    extra = connect_from("127.0.0.9", srv.port)          # one more from that address: served
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert read_all(extra).startswith(b"HTTP/1.1 200 ")
    oldest = read_all(hogs[0])
    assert oldest.startswith(b"HTTP/1.1 408 ") and b"body:" in oldest
    assert not any(closed_by_server(s) for s in hogs[1:])
    for s in hogs + [extra]:
        s.close()


def test_the_default_bounds_leave_room_for_local_clients():
    """The defaults: each address may hold a quarter of the server's connections, and its requests
    in progress (the Guard's share) are fewer than its connections, so no one address can hold
    every place with requests, and waiting connections (heads, bodies, idle) are always closable."""
    opts = ServerOptions()
    assert opts.max_client_requests < opts.max_client_connections <= opts.max_connections // 4
    assert opts.body_timeout_s <= 60 and opts.header_timeout_s <= 30


def test_bodies_trickled_from_the_local_address_itself_take_no_place_of_its_requests(start):
    """From 127.0.0.1, as every local client is: more bodies coming than the address may have
    requests in progress; its next request is served (a body still coming is not in progress)."""
    srv = start(max_client_requests=4, max_client_connections=16, header_timeout_s=60, body_timeout_s=60)
    slow = []
    for _ in range(8):
        s = connect_from("127.0.0.1", srv.port)
        s.sendall(HEAD)
        slow.append(s)
    assert srv.get("/health").status == 200
    chat = srv.chat(max_tokens=2, temperature=0)
    assert chat.status == 200, chat.body
    assert not any(closed_by_server(s) for s in slow)    # all still waiting for their bodies, none refused
    for s in slow:
        s.close()
