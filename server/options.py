"""What `ds4f serve` is told: the listener, the tokens (the API's and the operator's), the limits
that keep one client from starving the others, the engine queue, and the watchers of /events."""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from ds4f.api import MAX_GEN, MAX_PARALLEL, Ds4fError, parse_spec, read_regular

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8734
MIN_TOKEN_CHARS = 16
_TOKEN_RE = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")   # RFC 6750 b64token


@dataclass
class ServerOptions:
    model: str | None = None            # checkpoint; None: ds4f.toml's [model] path, else the demo model
    preset: str | None = None           # default preset of runs; None: ds4f.toml's engine.preset
    config_path: str | None = None      # ds4f.toml to use (passed on to every run)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    token: str | None = None            # bearer token; set: every endpoint requires it
    max_body_bytes: int = 8 << 20       # request bodies (an agent's conversation with its tools); larger get 413
    header_timeout_s: float = 10.0      # a request's line and headers must arrive within this
    body_timeout_s: float = 30.0        # its whole body within this of its headers (408 else)
    keep_alive_s: float = 5.0           # an idle keep-alive connection is closed after this
    max_connections: int = 512          # open connections in all; past it the oldest waiting one closes (503 if none)
    max_client_connections: int = 128   # open connections from one address; likewise, its oldest waiting one
    max_client_requests: int = 32       # requests in progress from one address; more get 429
    queue_size: int = 8                 # requests waiting for the engine; more get 429
    client_queue_share: int | None = None   # of them, from one address; None: half the queue (at least 1)
    default_max_tokens: int | None = None   # the most an answer without max_tokens generates (chat completions,
                                        # Responses); None: what the context leaves after the prompt
                                        # (completions: 16, as OpenAI's)
    served_model_names: tuple[str, ...] = ()   # the names requests may give as `model`, the first one listed
                                        # and reported; (): ds4f.toml's [server] served_model_name, else
                                        # the checkpoint directory's name
    cancel_wait_s: float = 5.0          # DELETE waits this long for the run to stop before answering 202
    access_log: bool = True             # one stderr line per request
    kv_dir: str | None = None           # the prefix cache's directory; None: ds4f.toml's [kv] dir
    reuse_prefix: bool = True           # False: every prompt computed whole
    parallel: int | None = None         # sequences decoded together; None: ds4f.toml's [server] parallel
    spec: str = "off"                   # speculative decoding of every run: off | auto | 1..3 drafts
    dump: str | None = None             # each request's state dump: full | compact | off; None: [dump] server
    operator_token: str | None = None   # the operator's token (POST /operator/...); None: [server] operator_token,
                                        # else a random one written to a 0600 file (operator_token_dir)
    operator_remote: bool | None = None  # operator endpoints answer peers beyond loopback; None: [server]
                                        # operator_remote
    operator_token_dir: str | None = None   # where the random token's file goes; None: the user's runtime dir
                                        # ($XDG_RUNTIME_DIR/ds4f), else state dir (platformdirs)
    max_watchers: int = 16              # GET /events streams open at once; more get 503
    watcher_queue: int = 256            # events a watcher may fall behind before it is dropped

    @property
    def queue_share(self) -> int:
        if self.client_queue_share is not None:
            return self.client_queue_share
        return max(1, (self.queue_size + 1) // 2)

    def check(self) -> None:
        """Ds4fError naming the option an operator must fix."""
        if not is_loopback(self.host) and not self.token:
            raise Ds4fError(f"--host {self.host}: serving beyond loopback requires a bearer token; "
                            f"write one to a file readable only by you and pass --token-file PATH")
        if not 0 <= self.port <= 65535:
            raise Ds4fError(f"--port: must be between 0 and 65535, got {self.port}")
        if not 0 <= self.queue_size <= 10_000:
            raise Ds4fError(f"--queue: must be between 0 and 10000, got {self.queue_size}")
        if not 1 <= self.max_client_requests <= 10_000:
            raise Ds4fError(f"--max-client-requests: must be between 1 and 10000, got {self.max_client_requests}")
        if self.parallel is not None and not 1 <= self.parallel <= MAX_PARALLEL:
            raise Ds4fError(f"--parallel: sequences decoded together, between 1 and {MAX_PARALLEL}, got {self.parallel}")
        try:
            parse_spec(self.spec)
        except Ds4fError as exc:
            raise Ds4fError(f"--spec: {str(exc).removeprefix('spec: ')}") from None
        if self.dump not in (None, "full", "compact", "off"):
            raise Ds4fError(f"--dump: full, compact or off, got {self.dump!r}")
        if self.default_max_tokens is not None and not 1 <= self.default_max_tokens <= MAX_GEN:
            raise Ds4fError(f"--max-tokens: must be between 1 and {MAX_GEN}, got {self.default_max_tokens}")
        check_model_names(self.served_model_names, "--served-model-name")
        if self.operator_token is not None:
            check_token(self.operator_token, "--operator-token")
        if not 1 <= self.max_watchers <= 1024:
            raise Ds4fError(f"max_watchers: must be between 1 and 1024, got {self.max_watchers}")
        if not 2 <= self.watcher_queue <= 65536:
            raise Ds4fError(f"watcher_queue: must be between 2 and 65536 events, got {self.watcher_queue}")


def check_model_names(names, where: str) -> tuple[str, ...]:
    """Model names as requests give them: non-empty strings without spaces, no name twice."""
    names = tuple(names)
    for name in names:
        if not isinstance(name, str) or not name or name != name.strip() or any(c.isspace() for c in name):
            raise Ds4fError(f"{where}: a model name is a non-empty string without spaces, got {name!r}")
    if len(set(names)) != len(names):
        raise Ds4fError(f"{where}: a name given twice in {', '.join(names)}")
    return names


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MAX_TOKEN_FILE = 64 << 10     # a token file larger than this is refused unread


def read_token_file(path: str | os.PathLike) -> str:
    """The bearer token in `path` (surrounding whitespace stripped); Ds4fError if unusable."""
    where = f"--token-file {path}"
    # a regular file of at most MAX_TOKEN_FILE bytes (a FIFO would block the start, a device never end)
    data = read_regular(path, "--token-file", MAX_TOKEN_FILE)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise Ds4fError(f"{where}: the token must be ASCII") from None
    token = text.strip()
    if not token:
        raise Ds4fError(f"{where}: the file is empty")
    return check_token(token, where)


def check_token(token: str, where: str) -> str:
    """A bearer token: at least MIN_TOKEN_CHARS characters of RFC 6750's b64token; Ds4fError if not."""
    if len(token) < MIN_TOKEN_CHARS:
        raise Ds4fError(f"{where}: the token is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                        f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if not _TOKEN_RE.match(token):
        raise Ds4fError(f"{where}: the token may only hold letters, digits and -._~+/ (one line)")
    return token
