"""Control messages between the serving process and the verifier: length-prefixed JSON over a
Unix socket pair.

Small things only: the config, admin requests and answers, events, finished spans, metric
expositions. Tensors never go here (they go through the sample ring). A message with an ``id``
is a request and gets exactly one reply carrying ``re`` = that id; ``call`` sends a request and
waits for its reply. Requests are handled on a small thread pool (a reload takes seconds and
must not hold up events behind it); one-way messages are handled in order on the reader thread.
When the other side goes away, pending calls fail with ``ConnectionError`` and ``on_close``
runs once.
"""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

log = logging.getLogger("guard.channel")
_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 256 * 1024 * 1024


class ChannelClosed(ConnectionError):
    pass


class Channel:
    def __init__(self, sock: socket.socket, handler: Callable[[dict], dict | None],
                 name: str, on_close: Callable[[], None] | None = None):
        self.sock = sock
        self.handler = handler
        self.name = name
        self.on_close = on_close
        self.closed = threading.Event()
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{name}-call")
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader",
                                        daemon=True)

    def start(self) -> "Channel":
        self._reader.start()
        return self

    # -- sending -------------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        data = json.dumps(message, default=str).encode()
        with self._send_lock:
            if self.closed.is_set():
                raise ChannelClosed(f"{self.name}: closed")
            try:
                self.sock.sendall(_LENGTH.pack(len(data)) + data)
            except OSError as exc:
                raise ChannelClosed(f"{self.name}: {exc}") from None

    def call(self, message: dict, timeout: float | None = 30.0) -> dict:
        """Send a request and wait for its reply; ``ChannelClosed`` or ``TimeoutError``."""
        return self.call_async(message).result(timeout)

    def call_async(self, message: dict) -> Future:
        future: Future = Future()
        ident = next(self._ids)
        with self._pending_lock:
            self._pending[ident] = future
        try:
            self.send({**message, "id": ident})
        except ChannelClosed as exc:
            with self._pending_lock:
                self._pending.pop(ident, None)
            future.set_exception(exc)
        return future

    # -- receiving -----------------------------------------------------------------------------
    def _recv_exact(self, n: int) -> bytes | None:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError:
                return None
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _read_loop(self) -> None:
        try:
            while True:
                header = self._recv_exact(_LENGTH.size)
                if header is None:
                    return
                (length,) = _LENGTH.unpack(header)
                if length > MAX_MESSAGE:
                    log.error("%s: message of %d bytes refused; closing", self.name, length)
                    return
                body = self._recv_exact(length)
                if body is None:
                    return
                self._dispatch(json.loads(body))
        finally:
            self._closed()

    def _dispatch(self, message: dict) -> None:
        if "re" in message:
            with self._pending_lock:
                future = self._pending.pop(message["re"], None)
            if future is not None and not future.done():
                future.set_result(message)
            return
        if "id" in message:
            self._pool.submit(self._answer, message)
            return
        try:
            self.handler(message)
        except Exception:  # a bad message must not end the channel
            log.exception("%s: handling %s failed", self.name, message.get("op"))

    def _answer(self, message: dict) -> None:
        try:
            reply = self.handler(message) or {}
        except Exception as exc:
            log.exception("%s: handling %s failed", self.name, message.get("op"))
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            self.send({**reply, "re": message["id"]})
        except ChannelClosed:
            pass

    def _closed(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.name}: the other side went away"))
        if self.on_close is not None:
            try:
                self.on_close()
            except Exception:
                log.exception("%s: on_close failed", self.name)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(5)
        self._closed()
        self._pool.shutdown(wait=False, cancel_futures=True)


class ForwardEvents(logging.Handler):
    """A child process's ``guard.events`` records go to its parent, which logs them: one event
    stream for the verifier and every serving process."""

    def __init__(self, channel: Channel):
        super().__init__()
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.send({"op": "event", "line": record.getMessage()})
        except ChannelClosed:
            sys.stderr.write(record.getMessage() + "\n")

    @classmethod
    def install(cls, channel: Channel) -> None:
        events = logging.getLogger("guard.events")
        events.handlers[:] = [cls(channel)]
        events.setLevel(logging.INFO)
        events.propagate = False
