"""OpenTelemetry traces: a span per ModelInfer, the mirrored comparison as its child span.

Why OpenTelemetry: it is what trace backends (Jaeger, Tempo, vendors) ingest, and its standard
``OTEL_*`` variables are how operators configure exporters. Off by default: tracing starts only
when ``OTEL_TRACES_EXPORTER`` is ``otlp`` or ``console`` (the SDK and OTLP exporter come with
the ``guard[otel]`` extra; the endpoint, headers and service name come from the usual
``OTEL_EXPORTER_OTLP_*`` and ``OTEL_SERVICE_NAME`` variables, read by the SDK itself). Health and
liveness RPCs are never traced. Incoming W3C ``traceparent`` metadata makes the guard's span a
child of the client's.

When tracing is off, ``enabled()`` is False and the request path skips all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os

from guard.errors import install_hint

log = logging.getLogger("guard.tracing")
_tracer = None


def enabled() -> bool:
    return _tracer is not None


def tracer():
    return _tracer


def use_provider(provider) -> None:
    """Trace with this TracerProvider (tests use the SDK's in-memory exporter); None stops."""
    global _tracer
    _tracer = provider.get_tracer("guard") if provider is not None else None


def configure_from_env() -> None:
    """Set up the SDK from ``OTEL_*`` variables, if ``OTEL_TRACES_EXPORTER`` asks for it."""
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter_name in ("", "none"):
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        log.warning("OTEL_TRACES_EXPORTER=%s but the OpenTelemetry SDK is not installed "
                    "(%s): tracing stays off", exporter_name, install_hint("otel"))
        return
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTLP exporter not installed (%s): tracing off", install_hint("otel"))
            return
        exporter = OTLPSpanExporter()
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console): tracing off",
                    exporter_name)
        return
    service = os.environ.get("OTEL_SERVICE_NAME", "guard")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    use_provider(provider)


def server_span(name: str, metadata, attributes: dict):
    """A SERVER span continuing the caller's trace (from gRPC metadata), or a null context."""
    if _tracer is None:
        return contextlib.nullcontext()
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    parent = propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})
    return _tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER,
                                         attributes=attributes)


def current_context():
    """The active trace context, to hand to work done later on another thread."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def child_span(name: str, parent_context, attributes: dict):
    if _tracer is None or parent_context is None:
        return contextlib.nullcontext()
    return _tracer.start_as_current_span(name, context=parent_context, attributes=attributes)


def set_attributes(span, attributes: dict) -> None:
    if span is not None and hasattr(span, "set_attributes"):
        span.set_attributes(attributes)


def inject(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """Outgoing metadata: the caller's, with the current span as ``traceparent`` when tracing
    (replacing the client's, so the upstream's span is a child of guard's)."""
    if _tracer is None:
        return metadata
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple((k, v) for k, v in metadata if k not in carrier) + tuple(carrier.items())


# -- spans across the process boundary -------------------------------------------------------
# The mirrored comparison runs in the verifier process, which has no exporter of its own: it
# records the span's times and attributes (``RecordedSpan``) and sends them to the serving
# process, which ends a real span with those times under the request's trace
# (``export_recorded``). One exporter, one service name, and the parent-child link intact.
def traceparent() -> str:
    """The current span as a W3C ``traceparent`` value ("" when tracing is off)."""
    if _tracer is None:
        return ""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


class RecordedSpan:
    """A span measured in the verifier: ``set_attributes`` like a real one, then ``as_dict``."""

    def __init__(self, name: str, parent: str, attributes: dict):
        import time

        self.name, self.parent = name, parent
        self.attributes = dict(attributes)
        self.start_ns = time.time_ns()
        self.end_ns = 0

    def set_attributes(self, attributes: dict) -> None:
        self.attributes.update(attributes)

    def end(self) -> dict:
        import time

        self.end_ns = time.time_ns()
        return {"name": self.name, "parent": self.parent, "start_ns": self.start_ns,
                "end_ns": self.end_ns, "attributes": self.attributes}


def export_recorded(record: dict) -> None:
    """End a real span with a ``RecordedSpan``'s times, as a child of its ``traceparent``."""
    if _tracer is None or not record.get("parent"):
        return
    from opentelemetry import propagate

    parent = propagate.extract({"traceparent": record["parent"]})
    span = _tracer.start_span(record["name"], context=parent, start_time=record["start_ns"],
                              attributes=record.get("attributes") or {})
    span.end(end_time=record["end_ns"])
