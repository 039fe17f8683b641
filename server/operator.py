"""The operator's actions on a running `ds4f serve`: POST /operator/{action}, a JSON body.

    backend   {"backend": "scalar|avx2|avx512|neon|auto"}     every live run at its next step,
    threads   {"kernel_threads"?: int, "io_threads"?: int}      and the runs that start after
    preset    {"preset": NAME}      the next requests' preset (a preset of ds4f.toml); live runs keep
                                    theirs: now when no run is live, else once none is (new requests
                                    wait meanwhile), the engine loaded anew by the next run
    cancel    {"run_id": ID}        that request's run stops at its next step; its client gets the
                                    error a cancelled run gives (a streaming one an error event)
    drain     {}                    what runs and waits finishes; new generation requests (and POST
                                    /runs) get 503 + Retry-After saying the server is draining
    resume    {}                    requests are taken again

Every answer: {"ok": true, "applied": {...}, "lands": "now" | "next step" | "next idle"}; every
action is an `operator` event of GET /events, with `who` ("operator@ADDRESS").

The operator's token: `ds4f serve --operator-token TOKEN`, else ds4f.toml's [server]
operator_token, else a random one the server makes at start and writes to a file only its user
can read (0600): `operator-token-PORT` in the user's runtime dir ($XDG_RUNTIME_DIR/ds4f), else in
its state dir (~/.local/state/ds4f); GET /status names it (`operator.token_file`), the startup log
too, and the server removes it when it stops. A request sends it as `Authorization: Bearer TOKEN`
or `X-Ds4f-Operator-Token: TOKEN` (which wins when both are sent, so Authorization can carry the
API token); on these paths it stands in for the API token. Only loopback peers are answered
unless `--operator-remote` ([server] operator_remote = true). Refusals, before anything is done:
a peer beyond loopback when that is not allowed 403, no token 401, a wrong one 403.
"""
from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

import platformdirs
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ds4f.api import BACKEND_NAMES, MAX_THREADS, Ds4fError

from .errors import HttpError, bad, json_response
from .options import is_loopback
from .request import checked_run_id, json_body, refused, whole_number

LABEL = "operator"           # the token's label in `who`
HEADER = "x-ds4f-operator-token"
ACTIONS = ("backend", "threads", "preset", "cancel", "drain", "resume")
PARAMS = {"backend": ("backend",), "threads": ("kernel_threads", "io_threads"), "preset": ("preset",),
          "cancel": ("run_id",), "drain": (), "resume": ()}


def token_dir() -> Path:
    """The user's runtime dir when the system gives one ($XDG_RUNTIME_DIR), else its state dir."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(platformdirs.user_runtime_dir("ds4f"))
    return Path(platformdirs.user_state_dir("ds4f"))


class OperatorAuth:
    """The operator's token, where it is written, and who may use it."""

    def __init__(self, token: str | None, remote: bool, directory: str | os.PathLike | None = None):
        self.given = token is not None
        self.token = token or secrets.token_urlsafe(32)
        self.remote = remote
        self.directory = Path(directory) if directory else None
        self.token_file: Path | None = None

    def write_file(self, port: int) -> Path | None:
        """A random token's file, 0600, in a 0700 directory of this user: `operator-token-PORT`.
        None when the token was given. Ds4fError if it cannot be written safely."""
        if self.given:
            return None
        directory = self.directory or token_dir()
        path = directory / f"operator-token-{port}"
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = directory.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise Ds4fError(f"operator token: {directory} is not a directory of this user; the token is not"
                                f" written there")
            if st.st_mode & 0o077:
                os.chmod(directory, 0o700)
            tmp = directory / f".operator-token-{port}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.write(fd, (self.token + "\n").encode("ascii"))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise Ds4fError(f"operator token: cannot write {path}: {exc.strerror or exc} (give one with "
                            f"--operator-token, or [server] operator_token)") from None
        self.token_file = path
        return path

    def remove_file(self) -> None:
        """The token's file, removed if it still holds this server's token."""
        path, self.token_file = self.token_file, None
        if path is None:
            return
        try:
            if path.read_text(encoding="ascii").strip() == self.token:
                path.unlink()
        except (OSError, UnicodeDecodeError):
            pass

    def view(self) -> dict:
        return {"token_file": str(self.token_file) if self.token_file else None, "loopback_only": not self.remote}

    def check(self, request: Request) -> str:
        """Who acts ("operator@ADDRESS"); else the refusal (403 beyond loopback when not allowed,
        401 without a token, 403 with a wrong one)."""
        peer = request.client.host if request.client else "-"
        if not self.remote and not is_loopback(peer):
            raise HttpError(403, f"operator: {peer} is not a loopback address; the operator's endpoints answer "
                                 f"only loopback peers (ds4f serve --operator-remote allows others)",
                            code="operator_remote_refused")
        sent = request.headers.get(HEADER)
        if sent is None:
            scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
            sent = credentials if scheme.lower() == "bearer" else None
        if sent is None or not sent.strip():
            raise HttpError(401, "operator: the operator's token is required: Authorization: Bearer <operator token> "
                                 "or X-Ds4f-Operator-Token: <operator token> (GET /status names its file:"
                                 " operator.token_file)", param="Authorization", code="operator_token_required",
                            headers={"WWW-Authenticate": 'Bearer realm="ds4f-operator"'})
        if not hmac.compare_digest(sent.strip().encode("latin-1", "replace"), self.token.encode("ascii")):
            raise HttpError(403, "operator: the token is not the operator's", param="Authorization",
                            code="operator_token_invalid")
        return f"{LABEL}@{peer}"


def _string(raw: dict, name: str, what: str) -> str:
    if name not in raw:
        raise bad(name, f"required: {what}", code="missing_parameter")
    value = raw[name]
    if not isinstance(value, str) or not value:
        raise bad(name, f"expected {what}, got {value!r}")
    return value


async def act(request: Request) -> Response:
    svc = request.app.state.service
    who = svc.operator.check(request)
    action = request.path_params["action"]
    if action not in ACTIONS:
        raise HttpError(404, f"no operator action {action!r} (actions: {', '.join(ACTIONS)})", code="not_found")
    raw = await json_body(request, "the action's parameters")
    unknown = [k for k in raw if k not in PARAMS[action]]
    if unknown:
        known = ", ".join(PARAMS[action]) or "none"
        raise bad(unknown[0], f"unknown parameter of {action} (known: {known})", code="unknown_parameter")
    if action == "backend":
        backend = _string(raw, "backend", f"a backend ({', '.join(BACKEND_NAMES)})")
        if backend not in BACKEND_NAMES:
            raise bad("backend", f"unknown backend {backend!r} (known: {', '.join(BACKEND_NAMES)})")
        if backend != "auto" and backend not in svc.backends:
            raise bad("backend", f"{backend} is not available on this machine (available: "
                                 f"{', '.join(svc.backends)})")
        applied, lands = svc.switch_all(who, backend=backend)
    elif action == "threads":
        counts = {k: whole_number(k, raw[k], from_query=False) for k in PARAMS["threads"] if k in raw}
        if not counts:
            raise bad("body", "nothing to switch: give kernel_threads, io_threads or both")
        for name, value in counts.items():
            if not 1 <= value <= MAX_THREADS:
                raise bad(name, f"must be between 1 and {MAX_THREADS}, got {value}")
        applied, lands = svc.switch_all(who, **counts)
    elif action == "preset":
        name = _string(raw, "preset", "a preset's name")
        applied, lands = svc.change_preset(name, who)
    elif action == "cancel":
        run_id = checked_run_id(_string(raw, "run_id", "a run's id"))
        try:
            applied, lands = await run_in_threadpool(svc.operator_cancel, run_id, who)
        except Ds4fError as exc:
            raise refused(exc, raw) from None
    elif action == "drain":
        applied, lands = svc.drain(who)
    else:
        applied, lands = svc.resume(who)
    return json_response(200, {"ok": True, "applied": applied, "lands": lands})
