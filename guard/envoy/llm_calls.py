"""An OpenAI-compatible call that Envoy's tap traced (a generation model's sampled call on
``server.http_port``), and the ``GenerationSample`` it makes for the verifier.

The tap sends a call once it has ended, whole: the request's JSON body and the answer's body
as the upstream wrote it, a JSON object or, for ``"stream": true``, every Server-Sent Event in
one buffer. The events are reassembled from that buffer exactly as the Python edge reassembles
them from a connection's chunks (guard/protocol/openai/answers.py ``gather_answer``: an event cut
anywhere by the upstream's writes is whole once the buffer is), so a streamed call makes the
same sample through Envoy as through the Python edge, but for what only the edge sees as the
events pass: the time to first token (a trace carries no timing; the call's time is Envoy's
``x-envoy-upstream-service-time``, the upstream's time to its answer's headers).

What cannot be compared is counted in ``guard_generation_not_comparable_total{model,reason}``
(for the sampled calls, the only ones guard sees in Envoy mode): ``n`` (best_of), ``tools``,
``prompt_list`` as on the edge; ``incomplete`` for a stream that ended before ``[DONE]`` (the
client went away, or the upstream broke off); ``upstream_error`` for an answer that is an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from guard.protocol import openai as api
from guard.protocol.generation import GenerationSample


@dataclass(frozen=True)
class ObservedHttpCall:
    path: str  # ":path" (the query string left out)
    request_id: str  # x-request-id (Envoy makes one for a call without)
    traceparent: str  # "" if none
    route: str  # response header `guard-route` ("" if absent)
    status: int  # the answer's HTTP status (0 if none came)
    content_type: str  # the answer's content-type
    request: bytes  # the client's JSON body
    response: bytes  # the answer's body: JSON, or the event stream
    seconds: float  # Envoy's x-envoy-upstream-service-time


class NotComparable(Exception):
    """A sampled call that makes no sample; ``reason`` is its label in
    guard_generation_not_comparable_total, ``model`` the model it named."""

    def __init__(self, model: str, reason: str):
        super().__init__(reason)
        self.model, self.reason = model, reason


def parse(call: ObservedHttpCall) -> api.ParsedCall | None:
    """The request of a traced call to one of the generation endpoints; None for another path,
    or a body that is not an OpenAI call (its upstream answered it as it saw fit)."""
    endpoint = api.PATHS.get(call.path)
    if endpoint is None:
        return None
    try:
        return api.parse_request(endpoint, call.request)
    except api.BadRequest:
        return None


def sample(call: ObservedHttpCall, parsed: api.ParsedCall, route: str,
           prompt_ids_asked: bool = False, probed_if_streamed: bool = False
           ) -> GenerationSample:
    """The sample of a traced call whose request is ``parsed``, answered on ``route``;
    ``NotComparable`` when the call makes none. ``prompt_ids_asked``: the verifier asks the
    primary's server for the prompt's ids; ``probed_if_streamed``: it probes the primary for a
    streamed chat that lists tools (``api.unusable``)."""
    if parsed.not_comparable:
        raise NotComparable(parsed.model, parsed.not_comparable)
    if not 200 <= call.status < 300:
        raise NotComparable(parsed.model, "upstream_error")
    streamed = call.content_type.startswith("text/event-stream")
    completion = api.gather_answer(parsed.endpoint, call.response, streamed)
    if completion.error:
        raise NotComparable(parsed.model, "incomplete" if completion.error == api.CUT_SHORT
                            else "upstream_error")
    unusable = api.unusable(completion, parsed, prompt_ids_asked, probed_if_streamed)
    if unusable:
        raise NotComparable(parsed.model, unusable)
    return api.build_sample(parsed, completion, route=route, request_id=call.request_id,
                            streamed=streamed, unix_nanos=time.time_ns(),
                            request_seconds=call.seconds, first_token_seconds=None)
