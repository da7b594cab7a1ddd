"""A lean HTTP/1.1 client for the HTTP edge's forwarding (backend ``openai``): one POST at a time
per connection, connections kept alive in a pool per upstream, the answer's body handed on as it
arrives (de-chunked), timeouts watched by one timer per call.

Why not aiohttp's client, which guard uses everywhere else (the start-up probe, the remote
scorer, the verifier's probe of a primary): on a streamed call this exchange is the one part of
guard on the path of time to first token, and aiohttp's ``ClientSession.post`` builds a
``ClientRequest`` for every call (the URL, merged and automatic headers, the cookie jar, redirects,
trace hooks, a timer re-armed on every read). A forwarder needs none of it: the client's bytes go
out as they came and the answer's bytes come back as they came. Measured side by side
(benchmarks/llm_edge.py --upstream paced, results/llm_edge_http1.md: a 2-core EPYC), the time
to first token guard adds went from +1.06 / +1.28 ms to +0.81 / +0.88 ms (two runs), and the
edge's CPU per streamed 32-token call to 0.86x. ``multidict`` (the answer's headers, duplicates
kept) comes with aiohttp.

What it speaks: HTTP/1.1 over TCP, or TLS for an ``https://`` target (the system's trust store,
as aiohttp's default context); bodies framed by ``Content-Length``, chunked (extensions and
trailers read and dropped) or by the connection's end; informational 1xx answers skipped. What it
does not: HTTP/2, proxies from the environment (aiohttp's ``trust_env`` was off too), redirects (a
3xx goes to the client as it came), compression (the edge does not forward Accept-Encoding).

Faults: an upstream that cannot be reached, or answers what is not HTTP/1.x (a head over
MAX_HEAD_BYTES, a header line holding a control character), or closes the connection before
its answer's end raises ``UpstreamError`` (a chunk-framing error after the body bytes decoded
before it; ``AnswerTooLarge`` past ``read``'s limit); silence longer than ``read`` (before
the answer's head, or between two reads of its body) or a call longer than ``total`` raises
``TimeoutError``. A connection goes back to the pool only after a whole answer that allows it
(HTTP/1.1, no ``Connection: close``, framed by length or chunks, nothing after it), and is
reused for at most MAX_IDLE_S after it; an answer left before its end (the client went away)
closes its connection, which stops the upstream's generation. A pooled connection that the
upstream closed while idle is noticed by the event loop and never reused.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import string
from typing import AsyncIterator, Mapping, NamedTuple
from urllib.parse import urlsplit

from multidict import CIMultiDict

# Longest head (status line and headers) accepted from an upstream, in bytes.
MAX_HEAD_BYTES = 64 * 1024
# Body bytes buffered from the upstream before reading pauses (the client reads slower than the
# upstream writes): back-pressure instead of memory.
HIGH_WATER_BYTES = 1 << 20
_HEX = frozenset(string.hexdigits.encode())
# Bytes no header line holds (RFC 9110 5.5: a bare CR or LF, NUL, other controls but HTAB),
# which aiohttp would also refuse to write to the client.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_NO_BODY = frozenset({204, 304})
# Longest a pooled connection is reused after its last answer, in seconds: under the 5 s
# keep-alive of uvicorn (vLLM, FastAPI servers) and cpp-httplib (llama-server), so that
# a call never goes out on a connection the upstream is closing at that moment (the client
# would get 502 for a call the upstream never read). Older idle connections are closed.
MAX_IDLE_S = 4.0


class UpstreamError(Exception):
    """The upstream could not be reached, answered what is not HTTP/1.x, or broke its answer
    off."""


class Unreachable(UpstreamError):
    """No connection could be made (refused, unreachable, no answer to connect in time): the
    call never went out, so another upstream may answer it (the edge's fallback spill)."""


class AnswerTooLarge(UpstreamError):
    """A whole answer longer than the reader takes (``Response.read``'s ``limit``)."""


class Timeouts(NamedTuple):
    """Seconds: to connect; of silence while an answer is awaited or read; for a whole call."""

    connect: float
    read: float
    total: float


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection: what arrived, whether it ended, a waiter to wake."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # the upstream closed (or the connection was lost)
        self.timed_out = False  # ended by the watchdog
        self.last_read = loop.time()
        self.idle_since = 0.0  # when it went back to the pool
        self.paused = False
        self._waiter: asyncio.Future | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.last_read = self.loop.time()
        if len(self.buffer) > HIGH_WATER_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    # -- for the answer ------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until more bytes arrive or the connection ends."""
        if self.ended or self.buffer:
            return
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """Everything that arrived since the last take."""
        data = bytes(self.buffer)
        self.buffer.clear()
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    @property
    def usable(self) -> bool:
        """Idle and still open (a pooled connection the upstream closed is not)."""
        transport = self.transport
        return (not self.ended and not self.buffer and transport is not None
                and not transport.is_closing())

    def close(self) -> None:
        """Close the connection; a reader waiting on it wakes and finds it ended."""
        if self.transport is not None:
            self.transport.close()
        self.ended = True
        self._wake()


class _Watchdog:
    """A call's timeouts, from its request's last byte to its answer's: past the read timeout
    (silence) or the total one, the connection is cut and the reader, woken, raises
    TimeoutError. One timer per call that looks again at the next deadline when it fires,
    instead of one re-armed on every read."""

    def __init__(self, conn: _Connection, timeouts: Timeouts):
        self.conn, self.timeouts = conn, timeouts
        self.deadline = conn.loop.time() + timeouts.total
        conn.last_read = conn.loop.time()
        self._handle = conn.loop.call_at(self._next(), self._fire)

    def _next(self) -> float:
        conn = self.conn
        silent_until = conn.last_read + self.timeouts.read
        if conn.paused:  # the client reads slower than the upstream writes: not silence
            silent_until = conn.loop.time() + self.timeouts.read
        return min(self.deadline, silent_until)

    def _fire(self) -> None:
        conn = self.conn
        if conn.ended:
            return
        due = self._next()
        if conn.loop.time() >= due:
            conn.timed_out = True
            conn.close()
        else:
            self._handle = conn.loop.call_at(due, self._fire)

    def cancel(self) -> None:
        self._handle.cancel()

    def error(self) -> TimeoutError:
        if self.conn.loop.time() >= self.deadline:
            return TimeoutError(f"the call took longer than {self.timeouts.total:g}s")
        return TimeoutError(f"the upstream was silent for {self.timeouts.read:g}s")


class _Chunked:
    """The chunked transfer coding, undone incrementally: ``feed`` returns the body bytes of
    what it is given (a chunk may span feeds); ``done`` after the last chunk and the trailer."""

    SIZE, DATA, DATA_END, TRAILER = range(4)

    def __init__(self):
        self.state = self.SIZE
        self.left = 0  # bytes of the current chunk's data still to come
        self.pending = b""  # an incomplete size or trailer line, or a data chunk's CR alone
        self.done = False
        self.extra = b""  # bytes after the body's end (none from a well-behaved upstream)
        # A framing error, raised by the feed after the one that found it: the body bytes
        # decoded before it are the client's first (they came as the upstream sent them).
        self.broken: UpstreamError | None = None

    def feed(self, data: bytes) -> bytes:
        if self.broken is not None:
            raise self.broken
        out: list[bytes] = []
        try:
            self._feed(data, out)
        except UpstreamError as exc:
            if not out:
                raise
            self.broken = exc
        return out[0] if len(out) == 1 else b"".join(out)

    def _feed(self, data: bytes, out: list[bytes]) -> None:
        buf = self.pending + data if self.pending else data
        self.pending = b""
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self.state == self.DATA:
                take = min(self.left, n - i)
                out.append(buf[i:i + take])
                i += take
                self.left -= take
                if not self.left:
                    self.state = self.DATA_END
            elif self.state == self.DATA_END:
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise UpstreamError("a chunk of the answer is not followed by CRLF")
                i += 2
                self.state = self.SIZE
            else:
                end = buf.find(b"\r\n", i)
                if end < 0:
                    if n - i > MAX_HEAD_BYTES:
                        raise UpstreamError("a chunk size line of the answer is too long")
                    break
                line, i = buf[i:end], end + 2
                if self.state == self.SIZE:
                    size = line.split(b";", 1)[0].strip()
                    if not size or not _HEX.issuperset(size):
                        raise UpstreamError(f"a chunk size of the answer is not hex: {line[:40]!r}")
                    self.left = int(size, 16)
                    self.state = self.DATA if self.left else self.TRAILER
                elif not line:  # the trailer's end
                    self.done = True
        if self.done:
            self.extra = buf[i:]
        else:
            self.pending = buf[i:]


def _parse_head(head: bytes) -> tuple[bool, int, CIMultiDict[str]]:
    """(HTTP/1.1?, status, headers) of an answer's head (without its blank line)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise UpstreamError(f"the upstream's answer is not HTTP/1.x: {lines[0][:60]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or _CONTROL.search(line):
            raise UpstreamError(f"a malformed header line in the upstream's answer: {line[:60]!r}")
        headers.add(name.decode("latin-1"), value.strip(b" \t").decode("utf-8", "surrogateescape"))
    return parts[0] == b"HTTP/1.1", int(parts[1]), headers


class Response:
    """An upstream's answer: ``status`` and ``headers`` once its head arrived; its body through
    ``iter_any`` (as it arrives) or ``read`` (whole). ``close`` when done with it: it is a no-op
    after the whole body (the connection is already back in the pool), else it closes the
    connection."""

    def __init__(self, pool: ConnectionPool, conn: _Connection, watchdog: _Watchdog,
                 http11: bool, status: int, headers: CIMultiDict[str], rest: bytes):
        self.status, self.headers = status, headers
        self._pool, self._conn, self._watchdog = pool, conn, watchdog
        self._rest = rest  # body bytes that came with the head
        self._chunked: _Chunked | None = None
        self._left = -1  # Content-Length bytes still to come; -1: to the connection's end
        tokens = {t.strip().lower() for t in headers.get("Connection", "").split(",")}
        self._keep_alive = http11 and "close" not in tokens
        encoding = headers.get("Transfer-Encoding")
        self._done = False
        if status in _NO_BODY or status < 200:
            self._left = 0
        elif encoding is not None:
            if encoding.rsplit(",", 1)[-1].strip().lower() == "chunked":
                self._chunked = _Chunked()
            else:  # another coding last: the body ends with the connection (RFC 9112 6.3)
                self._keep_alive = False
        elif "Content-Length" in headers:
            lengths = set(headers.getall("Content-Length"))
            length = lengths.pop().strip() if len(lengths) == 1 else ""
            if not length.isdigit():
                raise UpstreamError(f"the upstream's Content-Length is not one number: "
                                    f"{headers.getall('Content-Length')}")
            self._left = int(length)
        else:
            self._keep_alive = False
        if self._left == 0:
            self._finish(reusable=not rest)

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (each piece what one or more reads brought)."""
        conn = self._conn
        while not self._done:
            data, self._rest = self._rest or conn.take(), b""
            if data:
                body = self._decode(data)
                if body:
                    yield body
                if self._chunked is not None and self._chunked.broken is not None:
                    self.close()
                    raise self._chunked.broken
                continue
            if conn.ended:
                if conn.timed_out:
                    self.close()
                    raise self._watchdog.error()
                if self._left < 0 and self._chunked is None:  # framed by the connection's end
                    self._finish(reusable=False)
                    return
                self.close()
                raise UpstreamError("the upstream closed the connection before its answer's end")
            await conn.wait()

    async def read(self, limit: int = 0) -> bytes:
        """The whole body; AnswerTooLarge past ``limit`` bytes (0: no limit), its connection
        closed."""
        pieces, size = [], 0
        async for piece in self.iter_any():
            size += len(piece)
            if limit and size > limit:
                self.close()
                raise AnswerTooLarge(f"the upstream's answer is longer than {limit} bytes "
                                     "(server.max_message_bytes)")
            pieces.append(piece)
        return b"".join(pieces)

    def discard(self) -> None:
        """Close the connection, even after a whole answer (back in the pool by then): one the
        upstream is about to close too. llama-cpp-python's server ends a stream it failed and
        then closes the connection; taken again at once, before the event loop saw it close,
        it would answer nothing."""
        self._conn.close()

    def close(self) -> None:
        """Done with the answer: a connection whose answer is not whole is closed."""
        if not self._done:
            self._finish(reusable=False)

    # -- inside --------------------------------------------------------------------------------
    def _decode(self, data: bytes) -> bytes:
        if self._chunked is not None:
            body = self._chunked.feed(data)
            if self._chunked.done:
                self._finish(reusable=not self._chunked.extra)
            return body
        if self._left < 0:
            return data
        body = data[:self._left]
        self._left -= len(body)
        if not self._left:
            self._finish(reusable=len(data) == len(body))
        return body

    def _finish(self, reusable: bool) -> None:
        self._done = True
        self._watchdog.cancel()
        self._pool._release(self._conn, reusable and self._keep_alive)


class ConnectionPool:
    """Keep-alive connections to one upstream (``base``: ``http[s]://host[:port][/prefix]``),
    at most ``max_connections`` at once (0: no limit). Made on the event loop that uses it."""

    def __init__(self, base: str, timeouts: Timeouts, max_connections: int = 0):
        parts = urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base!r}")
        self.loop = asyncio.get_running_loop()
        self.timeouts = timeouts
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        default = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_line = f"Host: {host if default else f'{host}:{self.port}'}\r\n"
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._idle: list[_Connection] = []
        self._closed = False  # closed: answers still in flight close their connections
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send ``POST {prefix}{path}`` with ``body`` and ``headers`` (Host and Content-Length
        are the pool's) and wait for the answer's head."""
        if self._slots is not None:
            await self._slots.acquire()
        conn: _Connection | None = None
        watchdog: _Watchdog | None = None
        try:
            conn = self._idle_connection() or await self._connect()
            head = "".join([f"POST {self.prefix}{path} HTTP/1.1\r\n", self._host_line,
                            f"Content-Length: {len(body)}\r\n",
                            *[f"{name}: {value}\r\n" for name, value in headers.items()],
                            "\r\n"]).encode("utf-8", "surrogateescape")
            assert conn.transport is not None
            conn.transport.writelines([head, body])
            watchdog = _Watchdog(conn, self.timeouts)
            return await self._answer(conn, watchdog)
        except BaseException:
            if watchdog is not None:
                watchdog.cancel()
            if conn is not None:
                conn.close()
            if self._slots is not None:
                self._slots.release()
            raise

    async def close(self) -> None:
        """Close the idle connections (those in use close when their answers do)."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- inside --------------------------------------------------------------------------------
    def _idle_connection(self) -> _Connection | None:
        oldest = self.loop.time() - MAX_IDLE_S
        while self._idle:
            conn = self._idle.pop()
            if conn.usable and conn.idle_since > oldest:
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        try:
            _, conn = await asyncio.wait_for(self.loop.create_connection(
                lambda: _Connection(self.loop), self.host, self.port, ssl=self._ssl),
                self.timeouts.connect)
        except asyncio.TimeoutError:
            raise Unreachable(f"no connection to {self.host}:{self.port} in "
                              f"{self.timeouts.connect:g}s") from None
        except ssl.SSLError as exc:  # connected: a TLS mismatch is the config's, not an outage
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:  # refused, unreachable, unknown host
            raise Unreachable(f"{type(exc).__name__}: {exc}") from None
        return conn

    async def _answer(self, conn: _Connection, watchdog: _Watchdog) -> Response:
        """Wait for the answer's head (1xx heads skipped)."""
        received = b""
        while True:
            await conn.wait()
            received += conn.take()
            end = received.find(b"\r\n\r\n")
            if end < 0:
                if conn.timed_out:
                    raise watchdog.error()
                if len(received) > MAX_HEAD_BYTES:
                    raise UpstreamError("the upstream's answer head is too long")
                if conn.ended:
                    raise UpstreamError("the upstream closed the connection without answering")
                continue
            if end > MAX_HEAD_BYTES:
                raise UpstreamError("the upstream's answer head is too long")
            http11, status, headers = _parse_head(received[:end])
            received = received[end + 4:]
            if 100 <= status < 200 and status != 101:  # informational: the answer follows
                conn.buffer[:0] = received
                received = b""
                continue
            if status == 101:
                raise UpstreamError("the upstream switched protocols")
            return Response(self, conn, watchdog, http11, status, headers, received)

    def _release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and conn.usable and not self._closed:
            conn.idle_since = self.loop.time()
            self._idle.append(conn)
        else:
            conn.close()
        if self._slots is not None:
            self._slots.release()
