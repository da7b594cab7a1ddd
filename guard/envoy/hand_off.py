"""An observed call (guard/envoy/observer.py) into the sample ring, the way the Python data plane
hands off an upstream's answer (guard/serve/model.py ``hand_off``): the serialized
request and answer as they were, decoded only in the verifier.

Sampling was decided in Envoy (the model's sampled route), so every observed call of a model is
a sample: MIRROR when the model has a reference (and, on the fallback, only while probing, as in
the Python data plane), CAPTURE for capture mode "all". Runs on the observer's event loop: one
model lookup, a peek at the request's model name (guard/protocol/raw.py) and one copy into the
ring; never a wait. A full ring drops the sample and counts it, as on the request path.
"""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

from guard.ipc import wire
from guard.ipc.ring import SampleRing
from guard.observe.metrics import GuardMetrics
from guard.protocol import raw

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


class Sampled(Protocol):
    """What the hand-off needs of a served model (guard/serve/model.py's ServedModel)."""

    slot: int
    mirror_rate: float
    capture_rate: float

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
        model)."""
        if call.path != MODEL_INFER or call.grpc_status not in (0, None) or not call.response:
            return
        try:
            name = raw.peek(call.request)[0]
        except raw.MalformedMessage:
            return
        model = self.models().get(name)
        if model is None:
            return
        route, epoch, probing = model.route_word()
        if call.route in ("primary", "fallback"):
            route = call.route  # what answered it, from Envoy's guard-route header
        flags = 0
        if model.mirror_rate and (route != "fallback" or probing):
            flags |= wire.MIRROR
        if model.capture_rate:
            flags |= wire.CAPTURE
        if not flags:
            return
        sample = wire.Sample(name, model.slot, route, epoch, flags, call.request_id,
                             call.traceparent, call.seconds,
                             wire.Messages(call.request, call.response))
        if wire.hand_off(self.ring, sample, *self._dropped(name, flags)):
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
