"""What one client can make the front-end hold: a request body's size, and how long a request may take to arrive.

uvicorn reads a body only as the app asks for it, and times out only idle keep-alive connections, so without
these a 20 MB prompt is parsed whole on the event loop and a connection that sends half its headers (or half
its body) is held forever.
"""
from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from specserve.server.protocol import error_body


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class BodyLimit:
    """ASGI middleware: reads each request's body itself, at most `max_bytes` of it and within `read_timeout_s`,
    and hands the app the whole body at once. A body announced (Content-Length) or found (chunked) to be larger
    gets a 413 before more is read; one that does not arrive in time, a 408. Both close the connection."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, 413, f"the request body has {int(length)} bytes; the limit "
                                                          f"is {self.max_bytes} (--max-request-body-bytes)")
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout_s)
        except _Disconnected:
            return
        except _TooLarge:
            await self._refuse(scope, receive, send, 413, f"the request body is larger than {self.max_bytes} "
                                                          "bytes (--max-request-body-bytes)")
            return
        except asyncio.TimeoutError:
            await self._refuse(scope, receive, send, 408, f"the request body did not arrive within "
                                                          f"{self.read_timeout_s:g} s (--request-read-timeout)")
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then only http.disconnect, which the routes watch for

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(scope, receive, send, status: int, message: str) -> None:
        body = error_body(message, "invalid_request_error", status)
        await JSONResponse(body, status_code=status, headers={"connection": "close"})(scope, receive, send)


def h11_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, but a connection whose request headers have not all arrived `read_timeout_s`
    after it opened (or after its previous response) is closed. uvicorn's own keep-alive timeout stops counting
    at the first byte, so a client sending half a header line would hold the connection for good."""

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_overdue)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            # A request under way has its headers (BodyLimit times its body); none under way: idle or half-sent.
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return Protocol
