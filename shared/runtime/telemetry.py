"""OpenTelemetry tracing for actors: one tracer provider per service instance.

Trace context travels in NATS message headers as W3C ``traceparent``/``tracestate``, so a
chain of messages (signal -> exploration -> candidate -> verdict) is one trace. Spans go
to an OTLP endpoint when configured, else to ``<run_dir>/traces/<service>-<pid>.jsonl``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, Tracer, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from coevolve.shared.config import Settings

_propagator = TraceContextTextMapPropagator()


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(span)) for span in spans]
        with self._lock, self._path.open("a") as out:
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format_trace_id(ctx.trace_id) if ctx else None,
        "span_id": format_span_id(ctx.span_id) if ctx else None,
        "parent_span_id": format_span_id(parent.span_id) if parent else None,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
    }


def _plain(value: object) -> object:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return str(value)


def make_tracer_provider(service: str, instance: str, settings: Settings) -> TracerProvider:
    resource = Resource.create({"service.name": service, "service.instance.id": instance})
    provider = TracerProvider(resource=resource)
    exporter: SpanExporter | None
    match settings.telemetry.exporter:
        case "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = settings.telemetry.otlp_endpoint
            exporter = OTLPSpanExporter(endpoint=_traces_endpoint(endpoint)) if endpoint else None
        case "jsonl":
            exporter = JsonlSpanExporter(
                settings.run_dir / "traces" / f"{service}-{os.getpid()}-{instance[:6]}.jsonl"
            )
        case _:
            exporter = None
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def _traces_endpoint(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def inject(headers: dict[str, str], span_context: Context | None = None) -> dict[str, str]:
    """Write the current (or given) trace context into NATS headers."""
    _propagator.inject(headers, context=span_context)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    return _propagator.extract(dict(headers or {}))


def current_trace_id() -> str | None:
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format_trace_id(ctx.trace_id) if ctx.is_valid else None


def start_span(tracer: Tracer, name: str, parent: Context | None = None) -> Span:
    return tracer.start_span(name, context=parent)


def attach(ctx: Context) -> object:
    return otel_context.attach(ctx)


def detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]


def read_spans(directory: Path) -> list[dict[str, Any]]:
    """All spans exported as JSONL under ``directory`` (for tests and reports)."""
    spans: list[dict[str, Any]] = []
    for file in sorted(directory.glob("*.jsonl")):
        spans += [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return spans
