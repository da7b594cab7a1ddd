"""A real OpenAI-shaped HTTP server whose answers a test scripts (aiohttp, on 127.0.0.1, on a
thread of its own): the upstream for the faults a real model server does not produce on
demand (a stream held open, cut mid-event, cut off, an error event) and for what guard sent
it (headers, body). The test picks the script with the request header ``x-test-scenario``,
which guard forwards like any other header.

It records every request (path, headers, body) and, per scenario, whether the client went
away before the stream ended (``disconnected``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

MODEL = "scripted-upstream"


def chunk(text: str, model: str = MODEL, chat: bool = True, finish=None, index: int = 0
          ) -> bytes:
    choice = ({"index": index, "delta": {"content": text}, "finish_reason": finish} if chat
              else {"index": index, "text": text, "finish_reason": finish, "logprobs": None})
    body = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


RESPONSE_TEXT = ("Paris", " is", " the", " capital", ".")


def responses_answer(model: str = MODEL) -> dict:
    """A whole Responses API answer (vLLM's shape) of RESPONSE_TEXT."""
    return {"id": "resp_1", "object": "response", "model": model, "status": "completed",
            "output": [{"id": "msg_1", "type": "message", "role": "assistant",
                        "status": "completed",
                        "content": [{"type": "output_text", "annotations": [],
                                     "text": "".join(RESPONSE_TEXT), "logprobs": None}]}],
            "usage": {"input_tokens": 3, "output_tokens": len(RESPONSE_TEXT)}}


def responses_events(model: str = MODEL) -> list[bytes]:
    """The Responses API's stream of RESPONSE_TEXT: typed events, the last one whole, no
    [DONE]."""
    events = [{"type": "response.created",
               "response": dict(responses_answer(model), status="in_progress", output=[],
                                usage=None)}]
    events += [{"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                "content_index": 0, "delta": piece} for piece in RESPONSE_TEXT]
    events.append({"type": "response.completed", "response": responses_answer(model)})
    return [b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
            for e in events]


class ScriptedUpstream:
    def __init__(self, port: int = 0):
        """``port``: where to listen (0: a free one; a port again: the server back)."""
        self.requests: list[dict] = []
        self.disconnected = threading.Event()
        self.release = None  # asyncio.Event on the server loop ("hold")
        self.sent_last = threading.Event()
        # The script for requests without the header (guard's own probes send none).
        self.default_scenario = "plain"
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "ScriptedUpstream":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving (the server goes away); again: nothing."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_get("/v1/models", self._models)
        # Any other path (the endpoints guard forwards unchecked) answers by the same scripts.
        app.router.add_post("/{path:.*}", self._answer)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.release = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        self.requests.clear()
        self.default_scenario = "plain"
        self.disconnected.clear()
        self.sent_last.clear()
        self._loop.call_soon_threadsafe(self.release.clear)

    def let_go(self) -> None:
        """Let a held stream ("hold") send its last event."""
        self._loop.call_soon_threadsafe(self.release.set)

    # -- answers -----------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append({"path": request.path, "query": request.query_string,
                              "headers": dict(request.headers), "body": body})
        scenario = request.headers.get("x-test-scenario", self.default_scenario)
        chat = request.path.endswith("chat/completions")
        if scenario == "status":
            return web.json_response({"error": {"message": "no such thing", "type": "x"}},
                                     status=int(request.headers["x-test-status"]))
        if scenario == "max_logprobs" and _asks_more_logprobs_than(json.loads(body), 2):
            # vLLM 0.32 started with --max-logprobs 2, asked for 5 (its answer as it came)
            return web.json_response({"error": {
                "message": "Requested sample logprobs of 5, which is greater than max allowed: "
                           "2 (parameter=logprobs, value=5)",
                "type": "BadRequestError", "param": "logprobs", "code": 400}}, status=400)
        if scenario == "cookie":  # a server (or a balancer before it) that sets a cookie
            response = web.json_response({"id": "cmpl-1", "object": "chat.completion",
                                          "created": 1, "model": MODEL, "choices": []})
            response.set_cookie("upstream_session", "for-this-client-only", path="/")
            response.set_cookie("upstream_shard", "b", path="/")  # two Set-Cookie headers
            return response
        if scenario == "stall":  # no answer at all for longer than any read timeout a test sets
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
        if scenario in ("plain", "responses_cut") and request.path == "/v1/responses":
            if not json.loads(body).get("stream"):
                return web.json_response(responses_answer())
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            events = responses_events()
            # responses_cut: a clean close before the last event (which holds the answer)
            for event in events[:-1] if scenario == "responses_cut" else events:
                await response.write(event)
            await response.write_eof()
            return response
        if scenario == "nested":  # a whole answer nested deeper than Python's json reads
            return web.Response(body=b'{"model": "%s", "x": ' % MODEL.encode() + b"[" * 100_000
                                + b"]" * 100_000 + b"}", content_type="application/json")
        if scenario in ("plain", "max_logprobs"):
            answer = {"id": "cmpl-1", "object": "chat.completion", "created": 1,
                      "model": MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant",
                                                               "content": "Paris"}}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
            # Spacing and key order of the server's own: the edge must keep them.
            return web.Response(body=json.dumps(answer, indent=1).encode(),
                                content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await getattr(self, f"_{scenario}")(response, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return response

    async def _hold(self, response, chat) -> None:
        await response.write(chunk("first", chat=chat))
        await self.release.wait()
        await response.write(chunk(" last", chat=chat, finish="stop") + b"data: [DONE]\n\n")
        self.sent_last.set()
        await response.write_eof()

    async def _slow(self, response, chat) -> None:
        for i in range(2000):  # far longer than any test waits
            await response.write(chunk(f" t{i}", chat=chat))
            await asyncio.sleep(0.01)
        await response.write_eof()

    async def _split(self, response, chat) -> None:
        data = (chunk("Par", chat=chat) + b": a comment\r\n\r\n" + chunk("is", chat=chat)
                + chunk("", chat=chat, finish="stop") + b"data: [DONE]\n\n")
        for i in range(0, len(data), 7):  # cut anywhere, inside events and line ends
            await response.write(data[i:i + 7])
            await asyncio.sleep(0.001)
        await response.write_eof()

    async def _interleaved(self, response, chat) -> None:
        # Two completions (n = 2), their tokens a step apart and interleaved, as vLLM sends.
        for step, (first, second) in enumerate((("Par", "Ly"), ("is", "on"))):
            if step:
                await asyncio.sleep(0.05)
            await response.write(chunk(first, chat=chat))
            await response.write(chunk(second, chat=chat, index=1))
        await response.write(chunk("", chat=chat, finish="stop")
                             + chunk("", chat=chat, finish="stop", index=1) + b"data: [DONE]\n\n")
        await response.write_eof()

    async def _unfinished(self, response, chat) -> None:
        # A clean close before the stream's end: no finish_reason, no [DONE].
        await response.write(chunk("Par", chat=chat) + chunk("is", chat=chat))
        await response.write_eof()

    async def _die(self, response, chat) -> None:
        await response.write(chunk("one", chat=chat) + chunk(" two", chat=chat) + b"data: {\"id")
        await asyncio.sleep(0.05)
        response._req.transport.abort()  # the server process died: no end of the body

    async def _unterminated(self, response, chat) -> None:
        # The last event without its blank line: the body ends right after its data line.
        await response.write(chunk("Par", chat=chat)
                             + chunk("is", chat=chat, finish="stop").rstrip(b"\n") + b"\n")
        await response.write_eof()

    async def _endless_line(self, response, chat) -> None:
        # One data line that never ends (more than the test's server.max_message_bytes).
        await response.write(chunk("one", chat=chat) + b"data: {\"x\": \"")
        for _ in range(64):
            await response.write(b"y" * 65536)
            await asyncio.sleep(0)
        await response.write_eof()

    async def _error_event(self, response, chat) -> None:
        await response.write(chunk("one", chat=chat))
        await response.write(b'data: {"error": {"message": "out of memory", "type": '
                             b'"server_error"}}\n\n')
        await response.write_eof()


def _asks_more_logprobs_than(body: dict, limit: int) -> bool:
    asked = body.get("top_logprobs") if "messages" in body else body.get("logprobs")
    return isinstance(asked, int) and not isinstance(asked, bool) and asked > limit


def wait_until(predicate, timeout: float = 30.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()
