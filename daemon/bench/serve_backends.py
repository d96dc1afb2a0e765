"""The two transports of ``outrider bench serve`` (bench/serve.py): each sends one
``BenchRequest`` as a streamed request and times it into an ``Outcome`` (TTFT and ITL from the
arrival of its outputs with tokens; output tokens and speculative counts from the server's
usage where it reports them).

``ZmqBackend`` is the project's ``AsyncClient``; ``OpenAIBackend`` streams ``/v1/completions``
through httpx (imported on first use: the ``bench`` extra) from any OpenAI-compatible server
that takes ``ignore_eos``. A request the server answers with an error (over HTTP, a transport
error too) comes back as an ``Outcome`` carrying it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from outrider.daemon.bench.serve_data import BenchRequest
from outrider.daemon.bench.serve_report import Outcome
from outrider.protocol import AsyncClient, Grammar, RequestError, default_endpoint

REQUEST_TIMEOUT_S = 6 * 3600.0


class _Timer:
    """TTFT and ITL of one request from the arrival times of its outputs with tokens."""

    def __init__(self, out: Outcome) -> None:
        self.out = out
        self.start = time.perf_counter()
        self.last: float | None = None
        self.outputs = 0

    def output(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        self.outputs += 1

    def done(self) -> None:
        self.out.latency = time.perf_counter() - self.start
        self.out.success = True


class ZmqBackend:
    def __init__(self, endpoint: str | None, temperature: float, schema: str | None) -> None:
        self.client = AsyncClient(endpoint or default_endpoint(), timeout=REQUEST_TIMEOUT_S)
        self.temperature = temperature
        self.grammar = None if schema is None else Grammar("json_schema", schema)

    async def facts(self) -> dict[str, Any]:
        info = await self.client.server_info(timeout=10.0)
        return {
            "model": info.model,
            "configuration": info.configuration,
            "plugins": info.plugins,
        }

    async def run(self, req: BenchRequest) -> Outcome:
        out = Outcome(req.prompt_len, req.output_len)
        stream = self.client.stream(
            req.prompt,
            input_ids=req.prompt_ids,
            max_new_tokens=req.output_len,
            temperature=self.temperature,
            ignore_eos=self.grammar is None,  # a grammar's output ends where it ends
            grammar=self.grammar,
        )
        timer = _Timer(out)
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    timer.output()
        except RequestError as exc:
            out.error = f"{exc.code}: {exc.message}"
            return out
        assert stream.result is not None
        timer.done()
        usage = stream.result.usage
        out.prompt_len = usage.prompt_tokens
        out.output_tokens = usage.completion_tokens
        out.spec_drafts, out.spec_accepted = usage.spec_drafts, usage.spec_accepted_tokens
        return out

    async def close(self) -> None:
        self.client.close()


class OpenAIBackend:
    """Streamed ``/v1/completions``; outputs are the chunks with text."""

    def __init__(
        self, base_url: str, model: str | None, api_key: str, temperature: float, schema: str | None
    ):
        import httpx

        self._transport_errors = (httpx.HTTPError,)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0),
            limits=limits,
        )
        self.model = model
        self.temperature = temperature
        self.schema = None if schema is None else json.loads(schema)

    async def facts(self) -> dict[str, Any]:
        """The model (``--model``, else the first card of ``/v1/models``) and its card's
        ``max_model_len`` where the server reports one."""
        try:
            response = await self.http.get("/v1/models")
            response.raise_for_status()
            cards = response.json()["data"]
        except self._transport_errors as exc:
            if self.model is None:
                raise RuntimeError(f"{self.http.base_url}/v1/models: {exc}") from None
            cards = []
        self.model = self.model or str(cards[0]["id"])
        facts: dict[str, Any] = {"model": self.model, "base_url": str(self.http.base_url)}
        card: dict[str, Any] = next((c for c in cards if c.get("id") == self.model), {})
        if "max_model_len" in card:
            facts["max_model_len"] = card["max_model_len"]
        return facts

    async def run(self, req: BenchRequest) -> Outcome:
        out = Outcome(req.prompt_len, req.output_len)
        try:
            await self._stream(req, out)
        except self._transport_errors as exc:
            out.success = False
            out.error = f"{type(exc).__name__}: {exc}"
        return out

    async def _stream(self, req: BenchRequest, out: Outcome) -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": req.prompt if req.prompt is not None else req.prompt_ids,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.schema is None,  # a grammar's output ends where it ends
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": self.schema},
            }
        timer = _Timer(out)
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread()).decode()}"
                return
            async for event in _sse_data(response.aiter_lines()):
                if event == "[DONE]":
                    break
                chunk = json.loads(event)
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                    return
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    timer.output()
                if usage := chunk.get("usage"):
                    out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
                    out.output_tokens = usage.get("completion_tokens", 0)
                    out.spec_drafts = usage.get("spec_drafts", 0)
                    out.spec_accepted = usage.get("spec_accepted_tokens", 0)
        timer.done()
        out.output_tokens = out.output_tokens or timer.outputs

    async def close(self) -> None:
        await self.http.aclose()


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


Backend = ZmqBackend | OpenAIBackend
