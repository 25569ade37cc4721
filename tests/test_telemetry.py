"""Telemetry: trace context through headers, JSONL by default, OTLP when configured."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from coevolve.shared.config import load_settings
from coevolve.shared.runtime.telemetry import extract, inject, make_tracer_provider, read_spans


def test_context_round_trips_through_headers(tmp_path: Path) -> None:
    settings = load_settings(run_dir=str(tmp_path))
    provider = make_tracer_provider("svc", "i1", settings)
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("parent") as parent:
        headers = inject({})
    assert headers["traceparent"].split("-")[1] == format(
        parent.get_span_context().trace_id, "032x"
    )
    with tracer.start_as_current_span("child", context=extract(headers)) as child:
        assert child.get_span_context().trace_id == parent.get_span_context().trace_id
    provider.shutdown()
    spans = read_spans(tmp_path / "traces")
    assert {s["name"] for s in spans} == {"parent", "child"}
    assert {s["service"] for s in spans} == {"svc"}


def test_otlp_exporter_posts_spans_to_the_collector(tmp_path: Path) -> None:
    received: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            return

    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        settings = load_settings(run_dir=str(tmp_path))
        settings.telemetry.exporter = "otlp"
        settings.telemetry.otlp_endpoint = f"http://127.0.0.1:{server.server_port}"
        provider = make_tracer_provider("svc", "i1", settings)
        with provider.get_tracer("t").start_as_current_span("sent-to-collector"):
            pass
        assert provider.force_flush(5000)
        provider.shutdown()
    finally:
        server.shutdown()
    assert received and received[0][0] == "/v1/traces"
    assert b"sent-to-collector" in received[0][1]
    assert not (tmp_path / "traces").exists()
