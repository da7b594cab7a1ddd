"""Control messages between guard's processes (the primary serving process, the verifier, the
extra serving processes): length-prefixed JSON over a Unix socket pair.

The messages are the dataclasses of guard/ipc/messages.py (``to_wire``/``from_wire``); small
things only: the config, admin requests and answers, events, finished spans, metric
expositions. Tensors never go here (they go through the sample ring). A message with an ``id`` is a
request and gets exactly one reply carrying ``re`` = that id (``Done`` when the handler returns
nothing, ``Failed`` when it raises or the message's type is unknown); ``call`` sends a request and
waits for its reply. Requests are handled on a small thread pool (a reload takes seconds and must
not hold up events behind it); one-way messages are handled in order on the reader thread. When the
other side goes away, pending calls fail with ``ConnectionError`` and ``on_close`` runs once.
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

from guard.ipc.messages import Done, Event, Failed, Message, UnknownMessage, from_wire, to_wire

log = logging.getLogger("guard.channel")
_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 256 * 1024 * 1024


class ChannelClosed(ConnectionError):
    pass


class Channel:
    def __init__(self, sock: socket.socket, handler: Callable[[Message], Message | None],
                 name: str, on_close: Callable[[], None] | None = None):
        """``handler``: this end's handlers (``messages.Handlers``); it gets every message the
        other side sends and returns the reply to a request."""
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
    def send(self, message: Message) -> None:
        """A one-way message (no reply)."""
        self._send(to_wire(message))

    def _send(self, wire: dict) -> None:
        data = json.dumps(wire, default=str).encode()
        with self._send_lock:
            if self.closed.is_set():
                raise ChannelClosed(f"{self.name}: closed")
            try:
                self.sock.sendall(_LENGTH.pack(len(data)) + data)
            except OSError as exc:
                raise ChannelClosed(f"{self.name}: {exc}") from None

    def call(self, message: Message, timeout: float | None = 30.0) -> Message:
        """Send a request and wait for its reply (a ``Failed`` reply is returned, not raised);
        ``ChannelClosed`` or ``TimeoutError``."""
        return self.call_async(message).result(timeout)

    def call_async(self, message: Message) -> Future:
        future: Future = Future()
        ident = next(self._ids)
        with self._pending_lock:
            self._pending[ident] = future
        try:
            self._send({**to_wire(message), "id": ident})
        except ChannelClosed as exc:
            # The reader, seeing the other side go, may have taken the pending futures and
            # failed this one already: then it is not failed twice (a scrape of /metrics
            # while the verifier was killed answered 500 on that InvalidStateError).
            with self._pending_lock:
                ours = self._pending.pop(ident, None) is not None
            if ours:
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

    def _dispatch(self, wire: dict) -> None:
        if "re" in wire:
            with self._pending_lock:
                future = self._pending.pop(wire["re"], None)
            if future is not None and not future.done():
                try:
                    future.set_result(from_wire(wire))
                except UnknownMessage as exc:
                    future.set_result(Failed(f"{self.name}: undecodable reply: {exc}"))
            return
        if "id" in wire:
            self._pool.submit(self._answer, wire)
            return
        try:
            self.handler(from_wire(wire))
        except Exception:  # a bad message must not end the channel
            log.exception("%s: handling %s failed", self.name, wire.get("type"))

    def _answer(self, wire: dict) -> None:
        try:
            reply = self.handler(from_wire(wire)) or Done()
        except UnknownMessage as exc:
            reply = Failed(f"{self.name}: {exc}")
        except Exception as exc:
            log.exception("%s: handling %s failed", self.name, wire.get("type"))
            reply = Failed(f"{type(exc).__name__}: {exc}")
        try:
            self._send({**to_wire(reply), "re": wire["id"]})
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
            self.channel.send(Event(record.getMessage()))
        except ChannelClosed:
            sys.stderr.write(record.getMessage() + "\n")

    @classmethod
    def install(cls, channel: Channel) -> None:
        events = logging.getLogger("guard.events")
        events.handlers[:] = [cls(channel)]
        events.setLevel(logging.INFO)
        events.propagate = False
