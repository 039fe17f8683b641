"""uvicorn's HTTP/1.1 protocol (h11) with what it leaves out for a server facing slow clients.

uvicorn closes a connection idle between requests (timeout_keep_alive), but a client that
trickles a request line or headers a byte at a time, or connects and says nothing, keeps its
connection for ever. Here a request's line and headers must arrive within a deadline counted
from the connection's start or the previous answer: a whole-request deadline, not one per read.
(The body's deadline is the Guard's, see ds4f.server.guard.)

One address may hold only so many open connections, and the server so many in all; but a
connection that is only waiting (it has not sent a whole request head, its body is still coming,
or it is idle between requests) never holds a place a complete request needs: when a new
connection would pass a bound, the oldest waiting one (of that address, or of any) is closed to
make room (a 408 when part of a request came), and only when every connection is serving a
request is the new one refused (503). So half-open sockets or trickled bodies, from 127.0.0.1 as
every local client is or from many loopback addresses, cannot shut the well-behaved clients out.

A request's scope["state"] holds ABORT_KEY: a callable that cuts its connection at once, its
unsent bytes dropped (what /events does to a watcher that stopped reading: a graceful close
would wait for that client to read them).
"""
from __future__ import annotations

from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

ABORT_KEY = "ds4f.abort"


def protocol_class(header_timeout_s: float, max_client_connections: int, max_connections: int = 512) -> type:
    """The protocol class of one server (its own connections, by age and by address)."""
    return type("Ds4fH11Protocol", (DeadlineProtocol,),
                {"header_timeout_s": float(header_timeout_s), "max_client_connections": int(max_client_connections),
                 "max_connections": int(max_connections), "open_by_client": Counter(), "live": {}})


def _raw_answer(status: str, message: str, extra: str = "") -> bytes:
    body = ('{"error": {"message": "%s", "type": "%s", "param": null, "code": null}}\n'
            % (message, "timeout_error" if status.startswith("408") else "server_error")).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode() + body


class DeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0
    max_client_connections = 128
    max_connections = 512
    open_by_client: Counter = Counter()
    live: dict = {}          # the open connections, oldest first (a dict keeps insertion order)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._counted = True
        self._address = self.client[0] if self.client else "-"
        self.app_state = {**self.app_state, ABORT_KEY: self._abort}   # this connection's requests' scope["state"]
        self.open_by_client[self._address] += 1
        self.live[self] = None
        address = self._address
        if self.open_by_client[address] > self.max_client_connections and \
                not self._make_room(lambda p: p._address == address):
            return self._refuse(f"too many connections from your address (at most {self.max_client_connections},"
                                f" each serving a request)")
        if len(self.live) > self.max_connections and not self._make_room(lambda p: True):
            return self._refuse(f"too many connections (at most {self.max_connections}, each serving a request)")
        self._arm()

    def _waiting(self) -> bool:
        """Not serving a request: no request head yet, its body still coming (nothing answered
        yet: the Guard reads a body whole before an endpoint sees it), or idle after an answer."""
        cycle = self.cycle
        return cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started)

    def _body_coming(self) -> bool:
        cycle = self.cycle
        return cycle is not None and cycle.more_body and not cycle.response_started

    def _make_room(self, whose) -> bool:
        """Close the oldest waiting connection `whose` accepts (never this one); whether one was."""
        for other in list(self.live):
            if other is not self and whose(other) and other._waiting():
                other._drop()
                return True
        return False

    def _refuse(self, message: str) -> None:
        self.transport.write(_raw_answer("503 Service Unavailable", message, "Retry-After: 1\r\n"))
        self._uncount()
        self.transport.close()

    def _drop(self) -> None:
        """Close a waiting connection to make room: a 408 when part of a request (its head, or
        a head and part of its body) came."""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._uncount()
        if not self.transport.is_closing():
            if self._body_coming():
                self.transport.write(_raw_answer("408 Request Timeout", "body: the request body did not arrive"
                                                 " before the server needed the connection"))
            elif self.conn.trailing_data[0]:
                self.transport.write(_raw_answer("408 Request Timeout", "the request line and headers did not"
                                                 " arrive before the server needed the connection"))
            self.transport.close()

    def _abort(self) -> None:
        """Cut the connection now, dropping what was not sent (connection_lost follows)."""
        self._uncount()
        self.transport.abort()

    def _uncount(self) -> None:
        """Out of the counts at once (connection_lost comes later), once."""
        if not self._counted:
            return
        self._counted = False
        self.live.pop(self, None)
        left = self.open_by_client[self._address] - 1
        if left > 0:
            self.open_by_client[self._address] = left
        else:
            self.open_by_client.pop(self._address, None)

    def connection_lost(self, exc) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._uncount()
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
