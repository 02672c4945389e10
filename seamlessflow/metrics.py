"""Prometheus ``/metrics`` for every long-running process."""

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` server; ``port`` is the real one when 0 was asked for."""

    server: WSGIServer
    thread: Thread

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def url(self) -> str:
        host = self.server.server_address[0]
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(port: int = 0, host: str = "127.0.0.1") -> MetricsEndpoint:
    """Serve the default registry on ``host:port`` (0 picks a free port) in a daemon thread."""
    server, thread = start_http_server(port, addr=host)
    return MetricsEndpoint(server=server, thread=thread)
