"""An observed call (guard/envoy/observer.py) into the sample ring, the way the Python data plane
hands off an upstream's answer (guard/serve/model.py ``hand_off``): the serialized
request and answer as they were, decoded only in the verifier. A generation model's call
(an OpenAI-compatible HTTP call the tap traced, guard/envoy/llm_calls.py) goes as the
``GenerationSample`` the Python HTTP edge would have made of it (``wire.Generation``).

Sampling was decided in Envoy (the model's sampled route), so every observed call of a model is
a sample: MIRROR when the model has a reference (and, on the fallback, only while probing, as in
the Python data plane), CAPTURE for capture mode "all". Runs on the observer's event loop: one
model lookup, a peek at the request's model name (guard/protocol/raw.py) and one copy into the
ring; never a wait (a traced LLM call: its events parsed once, on the tap's reader thread). A
full ring drops the sample and counts it, as on the request path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Protocol

from guard.backends.openai import primary_options
from guard.config import ModelConfig
from guard.envoy.llm_calls import NotComparable, ObservedHttpCall, parse, sample
from guard.envoy.openai_listener import generative
from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.observe.metrics import GuardMetrics
from guard.protocol import raw
from guard.protocol.openai import served_model

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class Sampled(Protocol):
    """What the hand-off needs of a served model (guard/serve/model.py's ServedModel)."""

    slot: int
    mirror_rate: float
    capture_rate: float

    @property
    def config(self) -> ModelConfig: ...

    def route_word(self) -> tuple[str, int, bool]: ...


class HandOff:
    def __init__(self, models: Callable[[], Mapping[str, Sampled]], ring: SampleRing,
                 metrics: GuardMetrics):
        self.models = models
        self.ring = ring
        self.metrics = metrics
        self.handed = 0  # calls put into the ring
        self._drop_counters: dict[str, tuple] = {}

    def on_call(self, call) -> None:
        """The observer's ``on_call``: an ObservedCall into the ring (or not, and why not is
        an answer that cannot be compared: an error status, another method, an unknown
        model); an ObservedHttpCall as a generation sample."""
        if isinstance(call, ObservedHttpCall):
            self._generation(call)
            return
        if call.path != MODEL_INFER or call.grpc_status not in (0, None) or not call.response:
            return
        try:
            name = raw.peek(call.request)[0]
        except raw.MalformedMessage:
            return
        model = self.models().get(name)
        if model is None:
            return
        route, epoch, flags = self._routed(model, call.route)
        if flags:
            self._put(wire.Sample(name, model.slot, route, epoch, flags, call.request_id,
                                  call.traceparent, call.seconds,
                                  wire.Messages(call.request, call.response)))

    def _generation(self, call: ObservedHttpCall) -> None:
        parsed = parse(call)
        if parsed is None:
            return
        models = self.models()
        if not parsed.model:  # it named none: Envoy routed it to the one generation model
            name = served_model("", [n for n, m in models.items() if generative(m.config)])
            if name is None:  # (Envoy answered it 400 itself: several models)
                return
            parsed = dataclasses.replace(parsed, model=name)
        model = models.get(parsed.model)
        if model is None or not generative(model.config):  # a name the upstream answered
            return
        route, epoch, flags = self._routed(model, call.route)
        if not flags:
            return
        try:
            # (A tool chat's prompt ids may be the verifier's to ask of the primary's server,
            # a streamed one the verifier's to probe.)
            options = primary_options(model.config.primary) if parsed.offers_tools else None
            asked = options is not None and options.asks_prompt_ids
            probed = options is not None and options.probes_streamed_tool_chats
            generated = sample(call, parsed, route, asked, probed)
        except NotComparable as why:
            self.metrics.generation_not_comparable.labels(why.model, why.reason).inc()
            return
        self._put(wire.Sample(parsed.model, model.slot, route, epoch, flags, call.request_id,
                              call.traceparent, call.seconds, wire.Generation(generated)))

    @staticmethod
    def _routed(model: Sampled, answered_on: str) -> tuple[str, int, int]:
        """(route, epoch, flags) of an observed call of ``model``: the route that answered it
        (Envoy's guard-route header, else the model's route word); flags 0 when it is not to
        be handed on (on the fallback, mirrored only while probing, as in the Python data
        plane)."""
        route, epoch, probing = model.route_word()
        on_fallback = route == "fallback"
        if answered_on in ("primary", "fallback"):
            route = answered_on
        flags = 0
        # While the model is on its fallback, mirrored only while probing, whichever endpoint
        # answered: the primary standing in for a fallback that is down
        # (bootstrap.serving_cluster) gives a probe of the primary as it answered.
        if model.mirror_rate and (not on_fallback or probing):
            flags |= wire.MIRROR
        if model.capture_rate:
            flags |= wire.CAPTURE
        return route, epoch, flags

    def _put(self, sample: wire.Sample) -> None:
        if wire.hand_off(self.ring, sample, *self._dropped(sample.model, sample.flags)):
            self.handed += 1

    def _dropped(self, name: str, flags: int) -> tuple:
        """The model's ``dropped`` counters (mirror, capture), resolved once per model; the
        capture one only for a model that captures (no series for one that does not)."""
        counters = self._drop_counters.get(name)
        if counters is None or (flags & wire.CAPTURE and counters[1] is None):
            counters = self._drop_counters[name] = (
                self.metrics.mirror.labels(name, "dropped"),
                self.metrics.capture_records.labels(name, "dropped")
                if flags & wire.CAPTURE else None)
        return counters
