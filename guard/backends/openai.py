"""An OpenAI-compatible HTTP server as a backend (vLLM, llama.cpp's or llama-cpp-python's
server, TGI, SGLang, Triton's OpenAI frontend): the upstream of a generative model
(``task: generation``), forwarded by the HTTP edge on ``server.http_port``
(guard/serve/openai_edge.py).

The block::

    primary:
      backend: openai
      target: http://127.0.0.1:8081      # base URL (a trailing /v1 is allowed)
      model: smol-q4                     # the name the upstream serves
      options:
        api_key_env: UPSTREAM_KEY        # the NAME of the variable holding the key
        server_defaults: {top_k: 40, min_p: 0.05}   # what the server applies unless told

It forwards; it has no tensor inference (``infer`` raises) and refuses Open Inference Protocol
calls (FAILED_PRECONDITION: the model is served over HTTP). The forwarding client is guard's
lean HTTP/1.1 one (guard/backends/http1.py: why not aiohttp's, measured, is said there): one
``ConnectionPool`` per backend, opened on the serving event loop by ``connect()`` and reused by
every call; it is imported only then, so that `guard config validate` never imports it.

At start-up ``load()`` waits up to ``options.ready_timeout_s`` for ``GET {target}/v1/models``
to answer (a sidecar may start before its model server), with the standard library, on the
loading thread; a reload's load of an upstream that has answered before looks once, and one
that is down then is loaded all the same (event ``openai_upstream_not_ready``: ``ready_timeout``).
An upstream that does not list ``model`` is reported (event
``openai_model_not_listed``), not refused: some servers list a file path or one fixed name.
A block that leaves ``options.engine`` unknown in front of a server whose listing names its
engine (``owned_by``: llama-server's ``llamacpp``, vLLM's ``vllm``) is told which engine to
declare and what that turns on (event ``openai_engine_undeclared``): guard does not adopt it
unasked, since the engine decides how calls are sampled, amended and compared, in every
process, and a proxy may relay another server's listing.

In the ``reference`` role the same block is a remote scorer instead (``build``;
guard/backends/openai_scorer.py): the server scores the primary's completions. The options
class is shared; which options a role takes is checked per model (``_check_roles``).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Literal, Mapping, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from guard.backends.base import Backend, BackendInfo, Forwarding, ForwardingError, Role
from guard.backends.kind import BackendKind
from guard.errors import BackendError
from guard.protocol.generation import LOGPROBS_MODES, generation_config_defaults
from guard.protocol.openai.json_edits import REMOVE
from guard.observe.events import emit

if TYPE_CHECKING:  # (imported by the serving loop that uses them)
    import asyncio

    from guard.backends.http1 import ConnectionPool
    from guard.protocol.openai import CallShape

# Hop-by-hop headers (RFC 9110 7.6.1) and those the forwarder sets itself: never forwarded.
# Accept-Encoding is dropped so that the upstream answers uncompressed: the edge reads every
# streamed event (and edits the model name in it) as it passes.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    "accept-encoding", "content-encoding",
})


def end_to_end(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """``headers`` less the hop-by-hop ones: HOP_BY_HOP and those the message's own
    ``Connection`` header names (RFC 9110 7.6.1), which are for the next hop alone."""
    named = headers.get("Connection")
    dropped = HOP_BY_HOP if not named else HOP_BY_HOP | {
        token.strip().lower() for token in named.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in dropped]


# The statuses a server refuses a request's fields with (vLLM 400, FastAPI/pydantic servers
# 422, llama-cpp-python 500: started without --logits_all, its server fails any call that asks
# logprobs with "logprobs is not supported for models created with logits_all=False", and a
# streamed one with an empty stream, _Forward._stream): where guard had added logprobs or token
# ids, the call goes again as the client sent it (the HTTP edge's _Forward._as_the_client_asked,
# the probe's PrimaryProbe). A 500 that had nothing to do with guard's additions costs one more
# round trip, and the client gets the second answer, as it would have without guard.
REFUSALS = frozenset({400, 422, 500})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# (pydantic's schema needs the names spelled out; the protocol's tuple is their one list)
LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
assert get_args(LogprobsMode) == LOGPROBS_MODES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerDefaults(_Strict):
    """The sampling transform the server applies when a request does not say (None: not
    declared). The generation tier needs it to score a sampled completion: llama.cpp's
    server applies top_k 40, top_p 0.95, min_p 0.05, temperature 0.8 and repeat_penalty 1.0
    unless told; vLLM applies the model's generation_config.json. A sampled completion whose
    transform stays unknown is not comparable (counted, never scored)."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="0: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    penalty_last_n: int | None = Field(
        None, ge=-1, description="The penalties' window: the last that many tokens (-1: "
        "all; 0: no penalty). The engine's preset otherwise: llama.cpp and llama-cpp-python "
        "64 (llama-server's --repeat-last-n changes it, and a request's repeat_last_n), vLLM "
        "all.")


class OpenAIOptions(_Strict):
    api_key_env: str | None = Field(
        None, description="The name of an environment variable holding the upstream's API "
        "key, sent as 'Authorization: Bearer <key>' in place of the client's Authorization. "
        "Never the key itself: a config is not a secret store. Unset: the client's "
        "Authorization header is forwarded as it came.")
    engine: Literal["llama.cpp", "llama-cpp-python", "vllm", "openai", "unknown"] = Field(
        "unknown", description="The server's engine, for the sampling transform it applies "
        "where a request does not say: its sampler order (llama.cpp applies the temperature "
        "after top_k/top_p/min_p, vLLM before, and vLLM cuts by min_p before top_p's nucleus, "
        "the others after), the name it reads the repetition penalty under (vllm: "
        "repetition_penalty; llama.cpp, llama-cpp-python: repeat_penalty; each ignores the "
        "other; openai, unknown: either), its penalty window and its default values "
        "(llama.cpp, llama-server: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05; "
        "llama-cpp-python, its server: the same and repeat_penalty 1.1 over the sampled "
        "tokens; openai: "
        "temperature 1; vllm: those of generation_config, below). llama.cpp: the verifier "
        "asks the server at load what it samples with (GET /props: its defaults after the "
        "GGUF's general.sampling metadata and its flags) and takes that over the preset. "
        "server_defaults is laid over the preset. unknown: no preset; the sampling "
        "defaults are not known, so only greedy requests, requests that set the "
        "temperature and every truncation, and requests compared on their logprobs "
        "(sample_logprobs) are compared.")
    generation_config: str | None = Field(
        None, description="engine vllm: where vLLM takes its sampling defaults from, as its "
        "--generation-config names it: the model's generation_config.json (the file, or the "
        "model folder holding it), whose temperature, top_p, top_k, min_p and penalties vLLM "
        "applies to a request that does not set them (its default, 'auto'); 'vllm': vLLM's "
        "neutral defaults (temperature 1, no truncation: a server started with "
        "--generation-config vllm). Unset: not known, so a sampled call that leaves them to "
        "the server is not comparable (unless sample_logprobs makes it a logprobs "
        "comparison, which no transform enters). server_defaults is laid over it "
        "(vLLM's --override-generation-config).")
    server_defaults: ServerDefaults = Field(
        default_factory=ServerDefaults,
        description="The sampling defaults the server applies unless a request says "
        "otherwise (see ServerDefaults).")
    connect_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for a connection to the upstream; past it the "
        "client gets 502.")
    read_timeout_s: float = Field(
        120.0, gt=0, description="Longest silence while the upstream answers (before the "
        "first byte, or between two streamed events); past it the client gets 504 (or, "
        "mid-stream, a cut connection).")
    timeout_s: float = Field(
        600.0, gt=0, description="Longest time for a whole call, streamed or not.")
    ready_timeout_s: float = Field(
        60.0, ge=0, description="At start-up, how long to wait for GET /v1/models to answer.")
    sample_logprobs: int = Field(
        0, ge=0, le=20,
        description="On a sampled call whose client did not ask for logprobs, ask the upstream "
        "for this many top_logprobs per token (the per-token comparison needs them) and strip "
        "them from the client's answer (each choices[i].logprobs back to what the server "
        "answers unasked: null, or no key in llama-server's chat answers). For servers "
        "that answer logprobs for any request (vLLM up to its --max-logprobs; "
        "llama-cpp-python's server with --logits_all): a "
        "server that refuses a call so amended (400, 422, 500, or a stream ended without a "
        "byte) gets the client's own call instead, and calls of that shape (endpoint, streamed "
        "or not, with tools or not) are not amended again until a reload (event "
        "openai_additions_refused). Not added to a streamed chat that offers tools on "
        "engine llama.cpp (llama-server refuses logprobs there). 0: never add them.")
    sample_token_ids: bool = Field(
        False, description="On a sampled call whose client did not ask, ask the upstream for "
        "the token ids of the prompt and of the completion (vLLM's return_token_ids, vLLM >= "
        "0.10.2) and set them back to null in the client's answer (as vLLM answers unasked). "
        "The reference then scores the prompt as the server rendered it (chat template "
        "included, not an approximation) and takes the completion's tokens by id: a character "
        "sampled as several byte tokens, or a split the reference's tokenizer would not make, "
        "is compared instead of counted not comparable, and so are a reasoning model's "
        "answers (reasoning included) and a chat that offers tools (the prompt as the server "
        "rendered the tools, the call as the model generated it), which without ids are "
        "not comparable. Only for servers that take the field (vLLM): false: never add it.")
    tokenize_prompts: bool = Field(
        True, description="engine llama.cpp: on each sampled call the verifier asks the "
        "server how it rendered and tokenized the prompt (POST /apply-template for a chat, "
        "then POST /tokenize: llama-server answers both, and tells the ids in no answer), "
        "off the request path. The reference then scores the prompt the server read, not its "
        "own approximation, and compares it with its own rendering: a server that renders "
        "otherwise (--no-jinja's built-in template, another --chat-template, a tokenizer that "
        "splits otherwise, a BOS twice) is the finding prompt_rendered_otherwise. A server "
        "that does not answer them (an older llama-server, a proxy that passes only /v1) is "
        "not asked again until a reload (event llama_server_rendering_unavailable) and its "
        "calls are rendered by the reference. Other engines: no effect (vLLM tells the ids "
        "in its answer: sample_token_ids). false: never ask.")
    probe_streamed_tool_chats: bool = Field(
        False, description="engine llama.cpp: a sampled streamed chat that lists tools cannot "
        "be compared (llama-server gives no logprobs there, so no token ids of the call the "
        "model generated). true: the verifier asks the primary the same call again, not "
        "streamed, with logprobs, and compares that answer, as it probes the primary on a "
        "fallback's calls (off the request path; one more generation per such sampled call, "
        "on the primary). Needs tokenize_prompts (the prompt's ids). false: such calls are "
        "counted not comparable (tools).")
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="What the server's logprobs are, as vLLM's "
        "--logprobs-mode names it. raw_logprobs (vLLM's default, and what every other "
        "engine returns): the model's own distribution before sampling; compared with the "
        "reference's. processed_logprobs: after the request's sampling transform "
        "(temperature, top_k/top_p/min_p, penalties; tokens it masks at -9999): compared with "
        "the reference's distribution under the same transform, so the transform must be "
        "known (as for a sampled completion without logprobs) and the reference local. "
        "raw_logits, processed_logits: logits, not a distribution: not read (the reference "
        "alone judges the completion). A server whose logprobs show they are not raw "
        "(a value above 0, or masked tokens) while this says raw_logprobs has its calls "
        "counted not comparable (reason logprobs_mode), never scored as drift.")
    max_connections: int = Field(
        0, ge=0, description="Connections to the upstream at once; 0: no limit.")
    # The reference role (guard/backends/openai_scorer.py): a remote server scores given text.
    scoring: Literal["auto", "prompt_logprobs", "echo"] = Field(
        "auto", description="Reference only: how the server is asked to score a prompt of "
        "token ids. prompt_logprobs: vLLM's extra field (ids and texts of the best tokens); "
        "echo: echo with logprobs and max_tokens 0 (texts only); auto: the first of those the "
        "server answers. Either is checked at load against the server's own generation (the "
        "scored position must be the generated one): a server that cannot score, or whose "
        "scores sit a position off (llama-cpp-python's echo), is refused.")
    top_logprobs: int = Field(
        20, ge=1, le=1000, description="Reference only: the reference's best tokens the server "
        "returns per position (vLLM refuses more than its --max-logprobs, 20 unless set). The "
        "primary's alternatives outside them count in the tail bucket of the per-token KLD.")

    @property
    def asks_prompt_ids(self) -> bool:
        """The verifier asks this primary's server for each sampled prompt's token ids after
        the answer (llama-server: guard/backends/llama_server_prompts.py), so a call whose
        answer does not tell them (a chat that offers tools) still has them when it is
        scored."""
        return self.engine == "llama.cpp" and self.tokenize_prompts

    @property
    def probes_streamed_tool_chats(self) -> bool:
        """The verifier probes the primary for a sampled streamed chat that lists tools
        (``probe_streamed_tool_chats``, where the prompt's ids are asked too)."""
        return self.probe_streamed_tool_chats and self.asks_prompt_ids

    def refuses_logprobs(self, shape: CallShape) -> bool:
        """The server answers 400 to logprobs on such a call: llama-server refuses them on a
        streamed chat whose body lists tools ("logprobs is not supported with tools +
        stream"; earlier tool turns alone it takes). guard adds none there
        (options.sample_logprobs): such a call costs no refused round trip, not even the
        first one an undeclared engine's calls of that shape cost."""
        return self.engine == "llama.cpp" and shape.streamed and shape.tools

    def unasked_logprobs(self, endpoint: str) -> bytes:
        """What the server's answer holds for ``choices[i].logprobs`` where nobody asked:
        what guard sets back where it asked them itself (sample_logprobs). llama-server writes
        no key in a chat answer (streamed or whole; ``"logprobs": null`` in a completions
        one), the others null (vLLM, llama-cpp-python's server)."""
        return REMOVE if self.engine == "llama.cpp" and endpoint == "chat" else b"null"

    @model_validator(mode="after")
    def _generation_config_is_readable(self) -> "OpenAIOptions":
        if self.generation_config is not None:
            generation_config_defaults(self.generation_config)  # a JSON object, with numbers
        return self


def base_url(target: str) -> str:
    """An ``openai`` block's ``target`` as the base the API paths (``/v1/...``) go under: a
    trailing ``/`` or ``/v1`` left out."""
    target = target.rstrip("/")
    return target[:-3] if target.endswith("/v1") else target


def authorization(options: OpenAIOptions) -> str | None:
    """The Authorization header for the upstream (``options.api_key_env``), or None."""
    name = options.api_key_env
    if name is None:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise BackendError(f"environment variable {name} (options.api_key_env) is not set or "
                           "empty", key="options.api_key_env")
    return f"Bearer {key}"


# The engines a server's model listing names (``owned_by`` of GET /v1/models): llama-server
# writes "llamacpp", vLLM's model cards "vllm". llama-cpp-python's "me" is left out (too
# generic a word to tell a server by).
ENGINE_OWNERS = {"llamacpp": "llama.cpp", "vllm": "vllm"}
# What declaring each engine turns on, as the event openai_engine_undeclared says it.
_ENGINE_BENEFITS = {
    "llama.cpp": "its sampled calls are compared under the sampling defaults GET /props tells, "
                 "its prompts are asked as it rendered them (/apply-template, /tokenize), and "
                 "no logprobs are added to a streamed chat that lists tools (which it refuses "
                 "with 400, which would turn guard's additions off for the whole upstream)",
    "vllm": "its sampler's order and penalty names are known; with options.generation_config "
            "its defaulted sampled calls are compared, and options.sample_token_ids gives the "
            "prompt as it rendered it",
}


def wait_ready(base: str, model: str, authorization_header: str | None,
               timeout_s: float) -> tuple[tuple[str, str], ...]:
    """Wait up to ``timeout_s`` for ``GET {base}/v1/models`` to answer (a sidecar may start
    before its model server), with the standard library; the models it lists, as (id,
    owned_by) pairs."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(base + "/v1/models")
    if authorization_header:
        request.add_header("Authorization", authorization_header)
    last = "no answer"
    while True:
        try:
            with urllib.request.urlopen(request, timeout=2.0) as answer:
                data = json.loads(answer.read() or b"{}")
            _ANSWERED.add(base)
            return tuple((str(m.get("id")), str(m.get("owned_by") or ""))
                         for m in data.get("data") or () if isinstance(m, dict))
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code in (401, 403):  # a wrong key does not get better by waiting
                raise BackendError(f"openai {model}@{base}: GET /v1/models: {last} (check "
                                   "options.api_key_env)") from None
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise UpstreamNotReady(f"openai {model}@{base} not ready after {timeout_s:g}s "
                                   f"({last})")
        time.sleep(0.2)


class UpstreamNotReady(BackendError):
    """``wait_ready`` ran out of time (an upstream that refused the key is a plain
    BackendError: waiting does not mend it)."""


# The upstreams (base URLs) that have answered ``wait_ready`` in this process.
_ANSWERED: set[str] = set()


def ready_timeout(base: str, configured: float) -> float:
    """How long a load waits for ``base`` to answer: ``configured`` (``ready_timeout_s``: a
    sidecar may start before its model server) until it has answered once in this process;
    then one look. A later load is a reload, and an upstream down then is in an outage, which
    waiting does not mend: a reload that changed a model's sampling, in an incident where its
    fallback was down, waited a minute holding every other reload back, then failed."""
    return 0.0 if base in _ANSWERED else configured


def listed_engine(listing: tuple[tuple[str, str], ...], model: str) -> str | None:
    """The engine (an ``options.engine`` value) a server's model listing names for ``model``
    (its own entry, else the listing's one owner), or None."""
    owners = {owner for name, owner in listing if name == model} or \
        {owner for _, owner in listing}
    engines = {ENGINE_OWNERS.get(owner) for owner in owners}
    return engines.pop() if len(engines) == 1 else None


class UpstreamStatus(BackendError):
    """An upstream answered an HTTP error status: ``status`` and the start of its answer."""

    def __init__(self, message: str, status: int, text: str):
        super().__init__(message)
        self.status, self.text = status, text


def post_json(url: str, data: bytes, authorization_header: str | None, timeout_s: float,
              where: str) -> Any:
    """POST the JSON ``data`` to ``url`` with the standard library, outside the request path
    (the verifier's probe and prompt asks, ``guard replay``'s generation), one call at a time
    on a thread its caller watches: the JSON answer. :class:`UpstreamStatus` for an HTTP
    error status, BackendError for any other failure, each message starting with ``where``."""
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    if authorization_header:
        request.add_header("Authorization", authorization_header)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()[:300].decode("utf-8", "replace")
        raise UpstreamStatus(f"{where}: HTTP {exc.code}: {text}", exc.code, text) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BackendError(f"{where}: {type(exc).__name__}: {exc}") from None


def llama_server_settings(base: str, authorization_header: str | None,
                          timeout_s: float = 5.0) -> tuple[dict[str, Any] | None, str]:
    """The sampling settings a llama.cpp server (llama-server) applies where a request does not
    say: ``GET {base}/props``'s ``default_generation_settings.params`` (its built-in defaults,
    the GGUF's ``general.sampling.*`` metadata, then its launch flags, as it resolved them).
    (None, why) where the server does not answer them (another engine, an older llama-server,
    a proxy that does not pass /props)."""
    request = urllib.request.Request(base + "/props")
    if authorization_header:
        request.add_header("Authorization", authorization_header)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            data = json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return None, f"GET /props: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return None, f"GET /props: {type(exc).__name__}: {exc}"
    settings = data.get("default_generation_settings") if isinstance(data, dict) else None
    params = settings.get("params") if isinstance(settings, dict) else None
    if not isinstance(params, dict):
        return None, "GET /props: no default_generation_settings.params in the answer"
    return params, ""


def reported_settings(spec) -> tuple[dict[str, Any] | None, str]:
    """What a primary block's llama-server says it samples with (:func:`llama_server_settings`
    at its target, with its key): (params, "") or (None, why not)."""
    try:  # (a key that is not set: said by the edge's own load; here, the reason)
        header = authorization(OpenAIOptions.model_validate(spec.options))
    except BackendError as exc:
        return None, str(exc)
    return llama_server_settings(base_url(spec.target or ""), header)


class OpenAIBackend(Forwarding, Backend):
    def __init__(self, spec, role: Role, threads: int = 1):
        self.spec = spec
        self.role = role
        self.options = OpenAIOptions.model_validate(spec.options)
        self.base = base_url(spec.target)
        self.model = spec.model
        self._authorization: str | None = None
        # Opened by connect() on the serving loop.
        self.pool: ConnectionPool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.listed: tuple[str, ...] = ()
        # Why the upstream refused the logprobs or token ids guard adds to sampled calls
        # (options.sample_logprobs, sample_token_ids), by the shape of call it refused them on,
        # once the same call without them was answered: the edge then adds none to this
        # backend's calls of that shape (guard/serve/openai_edge.py).
        self.refused_additions: dict[CallShape, str] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        self._authorization = authorization(self.options)
        answered = self.base in _ANSWERED
        try:
            listing = wait_ready(self.base, self.model, self._authorization,
                                 ready_timeout(self.base, self.options.ready_timeout_s))
        except UpstreamNotReady as exc:
            if not answered:  # (ready_timeout_s may be 0: the flag, not the wait, says)
                raise
            # Forwarding needs nothing from it now: an outage after the start is answered 502
            # and counted, as it would be a second later.
            emit("openai_upstream_not_ready", model=self.model, target=self.base,
                 role=self.role, error=str(exc), note="loaded all the same: it answered "
                 "before; its calls get 502 (counted) until it is back")
            listing = ()
        self.listed = tuple(name for name, _ in listing)
        if self.listed and self.model not in self.listed:
            emit("openai_model_not_listed", model=self.model, target=self.base,
                 listed=list(self.listed)[:10],
                 note="forwarding anyway: the upstream may serve it under another listing")
        engine = listed_engine(listing, self.model)
        if self.options.engine == "unknown" and engine is not None:
            emit("openai_engine_undeclared", model=self.model, target=self.base,
                 role=self.role, engine=engine,
                 reason=f"options.engine is unknown, and the server's model listing names "
                        f"it {engine}: declare options.engine: {engine}, then "
                        f"{_ENGINE_BENEFITS[engine]}")

    async def connect(self, timeout: float = 5.0) -> bool:
        """Open the connection pool on the serving event loop (once)."""
        from guard.backends.http1 import ConnectionPool, Timeouts

        if self.pool is None:
            import asyncio

            self._loop = asyncio.get_running_loop()
            options = self.options
            # No cookie jar, no redirects: the pool carries every client's calls, so what an
            # upstream (or a balancer before it) sets or answers is the calling client's.
            self.pool = ConnectionPool(
                self.base, Timeouts(connect=options.connect_timeout_s,
                                    read=options.read_timeout_s, total=options.timeout_s),
                options.max_connections)
        return True

    async def aclose(self) -> None:
        """Close the pool on its own loop (the edge's stop, before the loop ends)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            await pool.close()

    def close(self) -> None:
        import asyncio

        pool, loop, self.pool = self.pool, self._loop, None
        if pool is None or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(pool.close())
        else:
            asyncio.run_coroutine_threadsafe(pool.close(), loop)

    def describe(self) -> BackendInfo:
        return BackendInfo(backend="openai", artifact=f"{self.model}@{self.base}",
                           precision="as served", device="remote", inputs=(), outputs=())

    # -- the request path (the HTTP edge) ------------------------------------------------------
    def headers(self, client: Mapping[str, str], request_id: str) -> dict[str, str]:
        """The client's headers for the upstream: hop-by-hop ones left out, the upstream's
        Authorization in place of the client's where ``api_key_env`` is set."""
        out = dict(end_to_end(client))
        if self._authorization is not None:
            for key in [k for k in out if k.lower() == "authorization"]:
                del out[key]
            out["Authorization"] = self._authorization
        if not any(k.lower() == "x-request-id" for k in out):
            out["X-Request-Id"] = request_id
        out["Content-Type"] = "application/json"
        return out

    # -- what this backend is not --------------------------------------------------------------
    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        raise BackendError(f"backend 'openai' ({self.model}@{self.base}) generates text over "
                           "HTTP: it has no tensor inference")

    async def forward(self, request, timeout, metadata=()):
        raise ForwardingError("FAILED_PRECONDITION", "model is generative (backend openai): "
                              "call it over OpenAI-compatible HTTP on server.http_port")

    async def forward_raw(self, data: bytes, timeout, metadata=()) -> bytes:
        return await self.forward(None, timeout, metadata)


def primary_options(spec) -> OpenAIOptions | None:
    """An ``openai`` primary block's options (None for another backend)."""
    return OpenAIOptions.model_validate(spec.options or {}) if spec.backend == "openai" \
        else None


def server_defaults(spec) -> ServerDefaults:
    """The declared sampling defaults of an ``openai`` block (for the generation tier)."""
    return OpenAIOptions.model_validate(spec.options).server_defaults


def _check(spec) -> None:
    if not spec.target or not spec.model:
        raise ValueError("backend 'openai' needs 'target' (the server's base URL, "
                         "http://host:port) and 'model' (the name it serves)")
    if spec.path is not None:
        raise ValueError("backend 'openai' takes 'target' and 'model', not 'path'")
    if spec.precision != "fp32":
        raise ValueError("backend 'openai' cannot derive a precision: the remote server runs "
                         "what it serves")
    if spec.device != "cpu":
        raise ValueError("backend 'openai' takes no device: the remote server runs where it "
                         "runs (guard sends it requests)")
    if not re.fullmatch(r"https?://(\[[0-9a-fA-F:.]+\]|[\w.\-]+)(:\d{1,5})?(/[\w.\-/]*)?",
                        spec.target):
        if "@" in spec.target.split("//", 1)[-1].split("/", 1)[0]:  # never echo a secret
            raise ValueError("target: credentials in the URL (user:password@) are not read; "
                             "give the server's key by options.api_key_env")
        raise ValueError(f"target '{spec.target}' must be a base URL: http://host:port")
    name = spec.options.get("api_key_env") if isinstance(spec.options, dict) else None
    if isinstance(name, str) and not _ENV_NAME.fullmatch(name):
        raise ValueError(f"options.api_key_env: {name[:4]}... is not the name of an environment "
                         "variable (letters, digits, '_'): give the variable's name, never the "
                         "key itself")


# Options that only mean something in one role: forwarding (primary, fallback) or scoring
# (reference).
FORWARDING_ONLY = ("engine", "generation_config", "server_defaults", "sample_logprobs",
                   "sample_token_ids", "tokenize_prompts", "probe_streamed_tool_chats",
                   "logprobs_mode", "max_connections")
REFERENCE_ONLY = ("scoring", "top_logprobs")


def _check_roles(model) -> None:
    for role in ("primary", "reference", "fallback"):
        spec = getattr(model, role)
        if spec is None or spec.backend != "openai" or not isinstance(spec.options, dict):
            continue
        other = FORWARDING_ONLY if role == "reference" else REFERENCE_ONLY
        wrong = [key for key in other if key in spec.options]
        if wrong:
            does = ("scores the primary's calls" if role == "reference"
                    else "forwards the clients' calls")
            raise ValueError(f"{role}.options.{wrong[0]}: is for an openai "
                             f"{'primary or fallback' if role == 'reference' else 'reference'}"
                             f"; the {role} {does}")
        engine = spec.options.get("engine", "unknown")
        if spec.options.get("generation_config") is not None and engine != "vllm":
            raise ValueError(f"{role}.options.generation_config: engine {engine} does not apply "
                             "a model's generation_config.json (vLLM does): declare the "
                             "server's defaults in server_defaults")


def _check_model(model) -> None:
    """Both routes of a generative model are OpenAI-compatible servers (the edge forwards
    either); a reference may be any scorer (an ``openai`` one scores remotely)."""
    _check_roles(model)
    roles = [r for r in ("primary", "fallback") if getattr(model, r) is not None]
    kinds = {r: getattr(model, r).backend for r in roles}
    if "openai" in kinds.values() and set(kinds.values()) != {"openai"}:
        other = next(r for r, k in kinds.items() if k != "openai")
        raise ValueError(f"{other}: backend '{kinds[other]}' beside an 'openai' "
                         f"{'primary' if other == 'fallback' else 'fallback'}: the HTTP edge "
                         "forwards either route, so both must be backend 'openai'")


def _check_config(config) -> None:
    if config.server.http_port is None and any(
            m.primary.backend == "openai" for m in config.models):
        raise ValueError("server.http_port: unset, but a model's primary is backend 'openai' "
                         "(served over OpenAI-compatible HTTP on that port)")


def build(spec, role: Role, threads: int = 1) -> Backend:
    """The ``openai`` block's backend: a forwarder for the routes, a remote scorer for the
    reference (guard/backends/openai_scorer.py, imported only then)."""
    if role == "reference":
        from guard.backends.openai_scorer import OpenAIScorer

        return OpenAIScorer(spec, role, threads)
    return OpenAIBackend(spec, role, threads)


KINDS = {
    "openai": BackendKind(
        name="openai", extra="llm-remote", backend=build,
        options=OpenAIOptions,
        precisions=frozenset({"fp32"}),  # the remote server runs what it runs
        artifact=False, forwards=True, check=_check, check_model=_check_model,
        check_config=_check_config, llm=frozenset({"serve", "score"}),
    ),
}
