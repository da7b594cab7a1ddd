"""guard's lean HTTP/1.1 client (guard/backends/http1.py) against real sockets: an asyncio server
in the test whose bytes each test scripts, so that every framing, fault and timeout the edge
relies on is exercised on the wire (the edge's end-to-end tests, tests/e2e/test_openai_edge*.py,
run it in front of a real aiohttp server and a real LLM server)."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.backends.http1 import (HIGH_WATER_BYTES, AnswerTooLarge, ConnectionPool, Timeouts,
                                  UpstreamError,
                                  _Chunked)

FAST = Timeouts(connect=2, read=5, total=10)


def chunked(body: bytes, sizes: list[int]) -> bytes:
    """``body`` in the chunked coding, cut at ``sizes`` (with an extension and a trailer)."""
    out, at = [], 0
    for size in sizes:
        piece = body[at:at + size]
        if not piece:
            break
        out.append(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
        at += len(piece)
    if at < len(body):
        out.append(b"%X\r\n%s\r\n" % (len(body) - at, body[at:]))
    return b"".join(out) + b"0\r\nX-Trailer: yes\r\n\r\n"


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=300), sizes=st.lists(st.integers(1, 40), max_size=10),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_the_chunked_coding_is_undone_wherever_the_reads_cut_it(body, sizes, cuts):
    wire = chunked(body, sizes) + b"NEXT"
    points = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
    decoder, out = _Chunked(), []
    for a, b in zip(points, points[1:]):
        if not decoder.done:
            out.append(decoder.feed(wire[a:b]))
        else:
            decoder.extra += wire[a:b]
    assert decoder.done and b"".join(out) == body and decoder.extra == b"NEXT"


@pytest.mark.parametrize("wire", [b"zz\r\nab\r\n0\r\n\r\n", b"2\r\nabXY0\r\n\r\n",
                                  b"0x2\r\nab\r\n0\r\n\r\n", b"\r\n"])
def test_a_malformed_chunk_is_an_upstream_error(wire):
    decoder = _Chunked()
    with pytest.raises(UpstreamError):
        decoder.feed(wire)
        decoder.feed(b"")  # (the body decoded before the fault came out first: below)


def test_the_body_before_a_framing_error_comes_out_before_the_error():
    decoder = _Chunked()
    assert decoder.feed(b"2\r\nabXY0\r\n\r\n") == b"ab"
    with pytest.raises(UpstreamError, match="CRLF"):
        decoder.feed(b"more")


class Script:
    """A TCP server on 127.0.0.1 whose answer to each request the test writes: ``answer(reader,
    writer, n)`` for the n-th request on a connection. Counts connections and their ends."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.closed = asyncio.Event()
        self.requests: list[bytes] = []
        self.open_now = 0
        self.most_open = 0

    async def __aenter__(self) -> "Script":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/prefix"

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            n = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                if await self.answer(reader, writer, n) is False:
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open_now -= 1
            writer.close()
            self.closed.set()


def run(coroutine):
    return asyncio.run(coroutine)


async def post(pool, body=b'{"x": 1}'):
    return await pool.post("/v1/chat/completions", body, {"Content-Type": "application/json",
                                                          "X-Request-Id": "r1"})


def test_requests_are_sent_as_given_and_answers_framed_by_length_reuse_the_connection():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nSet-Cookie: a=1\r\n"
                     b"Set-Cookie: b=2\r\n\r\nhello")

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            for _ in range(3):
                response = await post(pool)
                assert response.status == 200 and await response.read() == b"hello"
                assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
                response.close()
            assert server.connections == 1
            request = server.requests[0]
            assert request.startswith(b"POST /prefix/v1/chat/completions HTTP/1.1\r\n")
            assert b"\r\nHost: 127.0.0.1:%d\r\n" % server.port in request
            assert b"\r\nContent-Length: 8\r\n" in request and request.endswith(b'{"x": 1}')
            assert b"\r\nX-Request-Id: r1\r\n" in request
            await pool.close()

    run(main())


def test_a_pool_closed_while_an_answer_is_in_flight_closes_that_connection_after_it():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nlast")

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            response = await post(pool)
            await pool.close()  # a reload replaced the backend while this call was in flight
            assert await response.read() == b"last"
            await asyncio.wait_for(server.closed.wait(), 5)  # not kept by the closed pool

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece_before_its_end():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: text/event-stream\r\n\r\n")
        for i in range(3):
            writer.write(b"7\r\nevent %d\r\n" % i)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            for _ in range(2):
                response = await post(pool)
                pieces = [piece async for piece in response.iter_any()]
                assert b"".join(pieces) == b"event 0event 1event 2" and len(pieces) == 3
            assert server.connections == 1  # back in the pool after each whole answer
            await pool.close()

    run(main())


def test_an_answer_framed_by_the_connections_end_is_whole_and_its_connection_not_reused():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        return False

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            for _ in range(2):
                assert await (await post(pool)).read() == b"until the end"
            assert server.connections == 2
            await pool.close()

    run(main())


def test_connection_close_and_an_idle_connection_the_upstream_closed_are_not_reused():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    async def closes_when_idle(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return False  # closes its side after the answer: the pooled connection is stale

    async def main():
        for script in (answer, closes_when_idle):
            async with Script(script) as server:
                pool = ConnectionPool(server.base, FAST)
                for _ in range(2):
                    assert await (await post(pool)).read() == b"ok"
                    await asyncio.sleep(0.05)  # the upstream's close reaches the loop
                assert server.connections == 2
                await pool.close()

    run(main())


def test_informational_answers_are_skipped():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
                     b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")

    async def main():
        async with Script(answer) as server:
            response = await post(ConnectionPool(server.base, FAST))
            assert response.status == 201 and await response.read() == b"ok"

    run(main())


@pytest.mark.parametrize("wire", [b"SSH-2.0-OpenSSH\r\n\r\n", b"HTTP/1.1 2xx OK\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nX-Bare: a\rb\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nX-Nul: a\x00b\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nX-Big: " + b"h" * 70_000 + b"\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\nok"])
def test_an_answer_that_is_not_http_is_an_upstream_error(wire):
    async def answer(reader, writer, n):
        writer.write(wire)

    async def main():
        async with Script(answer) as server:
            with pytest.raises(UpstreamError):
                await post(ConnectionPool(server.base, FAST))

    run(main())


def test_a_whole_answer_past_the_readers_limit_is_refused():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3000\r\n\r\n" + b"x" * 3000)

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            with pytest.raises(AnswerTooLarge, match="longer than 1000 bytes"):
                await (await post(pool)).read(1000)
            assert await (await post(pool)).read(3000) == b"x" * 3000  # the pool still serves
            await pool.close()

    run(main())


def test_a_connection_idle_past_max_idle_is_not_reused(monkeypatch):
    """Under the upstream's own keep-alive: a call never goes out on a connection the upstream
    may be closing at that moment."""
    import guard.backends.http1 as http1

    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST)
            assert await (await post(pool)).read() == b"ok"
            assert await (await post(pool)).read() == b"ok"
            assert server.connections == 1  # reused at once
            monkeypatch.setattr(http1, "MAX_IDLE_S", 0.05)
            await asyncio.sleep(0.1)
            assert await (await post(pool)).read() == b"ok"
            assert server.connections == 2
            await pool.close()

    run(main())


def test_an_upstream_that_is_down_or_closes_without_answering_is_an_upstream_error():
    async def hangs_up(reader, writer, n):
        return False

    async def main():
        async with Script(hangs_up) as server:
            port = server.port
            with pytest.raises(UpstreamError, match="without answering"):
                await post(ConnectionPool(server.base, FAST))
        with pytest.raises(UpstreamError, match="ConnectionRefused"):
            await post(ConnectionPool(f"http://127.0.0.1:{port}", FAST))

    run(main())


def test_an_answer_cut_before_its_end_is_an_upstream_error_after_what_had_arrived():
    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n3\r\nla")
        return False

    async def main():
        async with Script(answer) as server:
            response = await post(ConnectionPool(server.base, FAST))
            received = []
            with pytest.raises(UpstreamError, match="before its answer's end"):
                async for piece in response.iter_any():
                    received.append(piece)
            assert b"".join(received) == b"firstla"

    run(main())


def test_silence_and_a_long_call_are_timeouts_and_leaving_early_closes_the_connection():
    async def silent(reader, writer, n):
        await asyncio.sleep(5)

    async def trickles(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):  # never silent for long, never done
            writer.write(b"1\r\n.\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def main():
        async with Script(silent) as server:
            pool = ConnectionPool(server.base, Timeouts(connect=2, read=0.3, total=10))
            with pytest.raises(TimeoutError, match="silent"):
                await post(pool)
            await asyncio.wait_for(server.closed.wait(), 5)  # the connection was cut
        async with Script(trickles) as server:
            pool = ConnectionPool(server.base, Timeouts(connect=2, read=0.3, total=0.6))
            response = await post(pool)
            with pytest.raises(TimeoutError, match="longer than"):
                async for _ in response.iter_any():
                    pass
            await asyncio.wait_for(server.closed.wait(), 5)
        async with Script(trickles) as server:  # the client leaves after the first piece
            response = await post(ConnectionPool(server.base, FAST))
            async for _ in response.iter_any():
                break
            response.close()
            await asyncio.wait_for(server.closed.wait(), 5)

    run(main())


def test_max_connections_holds_calls_until_a_connection_is_free():
    async def answer(reader, writer, n):
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    async def main():
        async with Script(answer) as server:
            pool = ConnectionPool(server.base, FAST, max_connections=2)

            async def call():
                return await (await post(pool)).read()

            assert await asyncio.gather(*[call() for _ in range(6)]) == [b"ok"] * 6
            assert server.most_open <= 2

    run(main())


def test_a_slow_reader_pauses_the_upstream_instead_of_buffering_it_whole():
    size = 8 * HIGH_WATER_BYTES
    body = bytes(random.Random(0).getrandbits(8) for _ in range(4096)) * (size // 4096)

    async def answer(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(body)
        await writer.drain()

    async def main():
        async with Script(answer) as server:
            response = await post(ConnectionPool(server.base, FAST))
            received, most = [], 0
            async for piece in response.iter_any():
                received.append(piece)
                most = max(most, len(piece))
                await asyncio.sleep(0.01)
            assert b"".join(received) == body
            assert most < 2 * HIGH_WATER_BYTES  # never the whole body at once

    run(main())


def test_an_https_upstream_is_verified_against_the_system_trust_store(tmp_path, monkeypatch):
    import ssl

    from pki import make_pki

    pki = make_pki(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki["server_cert"], pki["server_key"])

    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecret")
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
        base = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):
                await post(ConnectionPool(base, FAST))  # a CA the system does not trust
            monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))  # OpenSSL's own way to add one
            assert await (await post(ConnectionPool(base, FAST))).read() == b"secret"
        finally:
            server.close()

    run(main())
