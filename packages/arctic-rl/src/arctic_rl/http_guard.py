"""What the HTTP server checks before any route sees a request, so that a web page cannot drive it.

A browser lets any page send "simple" cross-origin requests without asking the server first (a preflight): a POST
with a ``text/plain`` or form body, and GETs. DNS rebinding goes further: a page whose name is made to resolve to
127.0.0.1 reads the answers too, as a same-origin page. The server therefore refuses, in this order:

1. a ``Host`` header that names neither a loopback name, nor the bound address, nor a name given with
   ``--allowed-host`` (421), which defeats DNS rebinding (a server bound to every interface, ``0.0.0.0`` or ``::``,
   takes any name: it has a token, which a page cannot know);
2. any request with an ``Origin`` header from another origin (403), token or not (a browser sends ``Origin`` with
   every cross-origin request and every POST; the server's own ``/docs`` page is its origin, and passes);
3. with a token: a request without exactly one ``Authorization: Bearer <token>`` header (the scheme in any case, the
   token compared in constant time): 401, or 400 for several ``Authorization`` headers;
4. a POST whose ``Content-Type`` is not JSON, the wire format or a slot reference (415): the two body types a page
   may send without a preflight never reach a parser.

Every refusal is the documented JSON error body ``{"error", "message"}``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from typing import Any

from arctic_rl.http_api import ACCEPTED_CONTENT_TYPES, is_loopback, media_type

__all__ = ["MIN_TOKEN_CHARS", "RequestGuard", "allowed_host_names", "json_error"]

# A token guards a server reachable from other machines: short ones can be guessed by trying.
MIN_TOKEN_CHARS = 24
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "127.0.0.1", "::1"})
_WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})


def allowed_host_names(bound_host: str, extra_names: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``bound_host`` answers (lowercase, without port), ``extra_names``
    included; None: any name (bound to every interface, where the token is the guard)."""
    if bound_host in _WILDCARD_ADDRESSES:
        return None
    return _LOOPBACK_NAMES | {name.lower().strip("[]") for name in (bound_host, *extra_names)}


def _host_name(header: str) -> str:
    """The name in a ``Host`` header, lowercase and without its port (``[::1]:7000`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_allowed_host(name: str, allowed: frozenset[str]) -> bool:
    # Any loopback literal (127.0.0.2, ...) names only this machine.
    return name in allowed or is_loopback(name)


def json_error(status: int, error: str, message: str, headers: Mapping[str, str] | None = None) -> Any:
    """A plain ASGI response with the server's JSON error body."""
    from starlette.responses import Response

    return Response(
        json.dumps({"error": error, "message": message}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class RequestGuard:
    """ASGI middleware applying the checks of the module doc to every HTTP request."""

    def __init__(self, app: Any, *, bound_host: str, allowed_hosts: tuple[str, ...], token: str | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_host_names(bound_host, allowed_hosts)
        self.token = None if token is None else token.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Any) -> Any:
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value)
        host = b",".join(headers.get(b"host", [])).decode("latin-1")
        if self.allowed_hosts is not None and not _is_allowed_host(_host_name(host), self.allowed_hosts):
            return json_error(
                421,
                "MisdirectedRequest",
                f"this server answers requests for {', '.join(sorted(self.allowed_hosts))} only, not Host {host!r} "
                "(a page that renamed this address is refused); connect to the address the server is bound to, or "
                "start it with --allowed-host NAME for a name of that address.",
            )
        origins = headers.get(b"origin", [])
        if origins and [origin.decode("latin-1") for origin in origins] != [f"http://{host}"]:
            return json_error(
                403,
                "CrossOriginRequest",
                f"requests from web pages of another origin ({origins[0].decode('latin-1')!r}) are refused; call "
                "the server from a program (the arctic-rl client sends no Origin header).",
            )
        if self.token is not None:
            supplied = headers.get(b"authorization", [])
            if len(supplied) > 1:
                return json_error(
                    400,
                    "Unauthorized",
                    f"the request carries {len(supplied)} Authorization headers; send exactly one: "
                    "'Authorization: Bearer <token>'.",
                )
            scheme, _, credentials = (supplied[0] if supplied else b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self.token):
                return json_error(
                    401,
                    "Unauthorized",
                    "this server needs a bearer token: send 'Authorization: Bearer <token>' with the token of its "
                    "--token-file (client: set token_file in the config).",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope["method"] == "POST":
            content_type = b",".join(headers.get(b"content-type", [])).decode("latin-1")
            if media_type(content_type) not in ACCEPTED_CONTENT_TYPES:
                return json_error(
                    415,
                    "UnsupportedMediaType",
                    f"a POST body must be {' or '.join(sorted(ACCEPTED_CONTENT_TYPES))}, got Content-Type "
                    f"{content_type or '<none>'!r}; send JSON with 'Content-Type: application/json' (also for an "
                    "empty body) or a batch in the wire format.",
                )
        return None
