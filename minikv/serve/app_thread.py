"""An ASGI app served by uvicorn on a thread of this process (the server's and the router's `Server`
classes for tests, notebooks and benchmarks; `minikv serve` and `minikv route` run in the foreground)."""
from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn


class AppThread:
    """An ASGI app served by uvicorn on a thread of this process, on a free loopback port by default."""

    label = "server"  # what the start error calls it

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", name: str = "minikv"):
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve(sockets=[self._sock])),
                                        name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0):
        self._thread.start()
        waited = 0.0
        while not self._uvicorn.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the {self.label} did not start on {self.url} within {timeout} s")
            threading.Event().wait(0.02)
            waited += 0.02
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
