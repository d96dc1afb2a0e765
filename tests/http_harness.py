"""A daemon serving HTTP (``outrider serve --http``) on the embedded family (or another model),
for the HTTP front's end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
from daemon_harness import Daemon, free_port, poll_until

from outrider.daemon.family import embedded_family

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAMILY = embedded_family()


class HttpDaemon:
    def __init__(
        self,
        workdir: Path,
        *args: str,
        speculative: str = "none",
        model: Path | None = None,
        wait: bool = True,
    ) -> None:
        """Starts the daemon and, unless ``wait`` is False, waits for it (``wait_up``)."""
        if model is None:
            assert FAMILY is not None
            model = FAMILY.target
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.daemon = Daemon(
            model,
            workdir,
            "--http", f"127.0.0.1:{self.port}",
            "--speculative-algorithm", speculative,
            *args,
        )  # fmt: skip
        if wait:
            self.wait_up()

    def wait_up(self) -> None:
        """Waits until the daemon serves and its HTTP front answers."""
        self.daemon.wait_serving()
        poll_until(self._http_up, 30.0, "the HTTP front answering")

    def _http_up(self) -> bool:
        try:
            return httpx.get(self.base + "/health/ready", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def openai(self, key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0)
