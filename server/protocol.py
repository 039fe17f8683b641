"""uvicorn's HTTP/1.1 protocol (h11) with what it leaves out for a server facing slow clients.

uvicorn closes a connection idle between requests (timeout_keep_alive), but a client that
trickles a request line or headers a byte at a time, or connects and says nothing, keeps its
connection for ever. Here a request's line and headers must arrive within a deadline counted
from the connection's start or the previous answer: a whole-request deadline, not one per read.
(The body's deadline is the Guard's, see ds4f.server.guard.) And one address may hold only so
many open connections, so one client cannot take every connection the server allows.
"""
from __future__ import annotations

from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol_class(header_timeout_s: float, max_client_connections: int) -> type:
    """The protocol class of one server (its own count of connections per address)."""
    return type("Ds4fH11Protocol", (DeadlineProtocol,),
                {"header_timeout_s": float(header_timeout_s), "max_client_connections": int(max_client_connections),
                 "open_by_client": Counter()})


def _raw_answer(status: str, message: str, extra: str = "") -> bytes:
    body = ('{"error": {"message": "%s", "type": "%s", "param": null, "code": null}}\n'
            % (message, "timeout_error" if status.startswith("408") else "server_error")).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode() + body


class DeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0
    max_client_connections = 128
    open_by_client: Counter = Counter()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._address = self.client[0] if self.client else "-"
        self.open_by_client[self._address] += 1
        if self.open_by_client[self._address] > self.max_client_connections:
            transport.write(_raw_answer("503 Service Unavailable", f"too many connections from your address (at "
                                        f"most {self.max_client_connections})", "Retry-After: 1\r\n"))
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        left = self.open_by_client[self._address] - 1
        if left > 0:
            self.open_by_client[self._address] = left
        else:
            self.open_by_client.pop(self._address, None)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return   # a request is being served: its headers came in time
        if self.conn.trailing_data[0]:   # part of a request came: say why the connection closes
            self.transport.write(_raw_answer("408 Request Timeout", f"the request line and headers did not "
                                             f"arrive within {self.header_timeout_s:g} s"))
        self.transport.close()
