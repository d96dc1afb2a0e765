"""End to end: ``outrider serve --http`` on the embedded family, driven by the official
``openai`` client (sync and async) and by raw server-sent events through ``httpx``."""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
from daemon_harness import poll_until
from http_harness import API_KEY, AUTH, FAMILY, HttpDaemon

from outrider.protocol import Client
from outrider.protocol.messages import ServerInfo

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed"),
]


@pytest.fixture(scope="module")
def server(family_http: HttpDaemon) -> HttpDaemon:
    return family_http


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_health_and_version(server: HttpDaemon) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["outrider-family"]
    assert httpx.get(server.base + "/health").json() == {"status": "serving"}
    assert httpx.get(server.base + "/version", headers=AUTH).json()["version"] == "0.1.0"


def test_completions_stream_equals_non_streamed(server: HttpDaemon) -> None:
    client = server.openai()
    params = dict(
        model="outrider-family", prompt="Once upon a time", max_tokens=24, temperature=0.9,
        seed=11, extra_body={"ignore_eos": True, "top_k": 40},
    )  # fmt: skip
    full = client.completions.create(**params)  # type: ignore[call-overload]
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    assert full.usage.prompt_tokens_details is not None
    pieces, usage = [], None
    for chunk in client.completions.create(
        stream=True,
        stream_options={"include_usage": True},
        **params,  # type: ignore[arg-type]
    ):
        pieces += [choice.text for choice in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == full.choices[0].text
    assert usage is not None and usage.completion_tokens == 24


async def test_async_chat_stream_and_not(server: HttpDaemon) -> None:
    client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    full = await client.chat.completions.create(
        model="outrider-family", messages=messages, max_completion_tokens=16, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # type: ignore[call-overload]  # fmt: skip
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == full.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    stream = await client.chat.completions.create(
        model="outrider-family", messages=messages, max_tokens=16, temperature=0, stream=True
    )  # type: ignore[call-overload]
    text, reasons = "", []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == choice.message.content
    assert reasons[-1] == choice.finish_reason and reasons[:-1] == [None] * (len(reasons) - 1)
    await client.close()


def test_raw_sse_usage_chunk_and_done(server: HttpDaemon) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_errors_in_the_openai_shape(server: HttpDaemon) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="outrider-family", prompt="x", n=17)
    assert bad.value.status_code == 400 and bad.value.param == "n"  # type: ignore[attr-defined]
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        server.openai("wrong-key").models.list()
    assert unauthorized.value.status_code == 401
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(model="outrider-family", prompt=[5] * 600, max_tokens=1)
    assert too_long.value.status_code == 413
    assert too_long.value.body["code"] == "prompt_too_long"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as too_long_streamed:
        client.completions.create(
            model="outrider-family", prompt=[5] * 600, max_tokens=1, stream=True
        )
    assert too_long_streamed.value.status_code == 413
    # max_tokens past the context is refused (as vLLM does), named as the client sent it.
    with pytest.raises(openai.BadRequestError) as past:
        client.completions.create(model="outrider-family", prompt=[5] * 20, max_tokens=500)
    assert past.value.param == "max_tokens"  # type: ignore[attr-defined]
    assert past.value.body["message"] == (  # type: ignore[index]
        "500 new tokens after a prompt of 20 tokens pass the context length of 512: at most "
        "492 new tokens fit - at `$.max_tokens`"
    )
    with pytest.raises(openai.BadRequestError) as past_chat:
        client.chat.completions.create(
            model="outrider-family",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=512,
        )
    assert past_chat.value.param == "max_completion_tokens"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.completions.create(model="gpt-4", prompt="x")
    assert unknown_model.value.code == "model_not_found"
    raw = httpx.post(
        server.base + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def _aborted_since(zmq_client: Client, aborted_before: int) -> ServerInfo:
    """The daemon's state once more requests have been aborted than ``aborted_before``."""
    return poll_until(
        lambda: (
            info
            if (info := zmq_client.server_info()).requests_finished.get("abort", 0) > aborted_before
            else None
        ),
        10.0,
        "the request aborted",
    )


def test_a_disconnect_mid_stream_aborts_the_request(server: HttpDaemon) -> None:
    with Client(server.daemon.endpoint) as zmq_client:
        aborted_before = zmq_client.server_info().requests_finished.get("abort", 0)
        body = {"prompt": "The", "max_tokens": 400, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream(
            "POST", server.base + "/v1/completions", json=body, headers=headers
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            during = zmq_client.server_info()
            assert during.running == 1
        # The connection is closed: the request is aborted long before its 400 tokens.
        after = _aborted_since(zmq_client, aborted_before)
        assert after.running == 0 and after.waiting == 0
        assert after.kv_used_tokens <= during.kv_used_tokens


def test_a_client_gone_before_a_non_streamed_answer_aborts_the_request(
    server: HttpDaemon,
) -> None:
    with Client(server.daemon.endpoint) as zmq_client:
        aborted_before = zmq_client.server_info().requests_finished.get("abort", 0)
        # 480 tokens take about 0.35 s on an H100 and seconds on a CPU: the client gives up
        # after 0.1 s and closes the connection while the request runs.
        body = {"prompt": "The", "max_tokens": 480, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=0.1)
        after = _aborted_since(zmq_client, aborted_before)
        assert after.running == 0 and after.waiting == 0


def test_sigterm_drains_running_streams_and_refuses_new_ones(tmp_path: Path) -> None:
    http = HttpDaemon(tmp_path)
    try:
        client = http.openai("none")
        stream = client.completions.create(
            model="outrider-family", prompt="A", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # type: ignore[call-overload]  # fmt: skip
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        http.daemon.send_signal(signal.SIGTERM)
        refused: list[int] = []

        def late_request() -> None:
            try:
                client.completions.create(model="outrider-family", prompt="B", max_tokens=2)
            except openai.APIStatusError as exc:
                refused.append(exc.status_code)
            except openai.APIConnectionError:
                refused.append(-1)

        poll_until(lambda: "draining" in http.daemon.log(), 10.0, "the daemon draining")
        thread = threading.Thread(target=late_request)
        thread.start()
        reasons = [c.finish_reason for chunk in stream for c in chunk.choices]
        thread.join(10)
        assert reasons[-1] == "length"
        assert refused == [503]
        assert http.daemon.wait_exit() == 0
        http.daemon.wait_group_gone()
    finally:
        http.daemon.kill_all()


def test_logit_bias_and_penalties_change_greedy_outputs(server: HttpDaemon) -> None:
    """Greedy with a bias of 100 on one token: that token every time; with a repetition
    penalty: another continuation of a prompt that plain greedy repeats."""
    client = server.openai()
    params = dict(model="outrider-family", prompt="Once upon a time", max_tokens=12, temperature=0)
    token = httpx.post(server.base + "/tokenize", json={"prompt": " sea"}, headers=AUTH).json()
    favoured = token["tokens"][-1]
    biased = client.completions.create(**params, logit_bias={str(favoured): 100})  # type: ignore[call-overload]
    repeated = httpx.post(
        server.base + "/detokenize", json={"tokens": [favoured] * 12}, headers=AUTH
    ).json()["prompt"]
    assert biased.choices[0].text == repeated
    params["prompt"] = "sea sea sea sea sea sea"
    plain = client.completions.create(**params).choices[0].text  # type: ignore[call-overload]
    assert plain.startswith(" sea sea")
    penalized = client.completions.create(**params, extra_body={"repetition_penalty": 2.0})  # type: ignore[call-overload]
    assert "sea" not in penalized.choices[0].text


def test_n_choices_are_the_requests_of_seed_plus_i(server: HttpDaemon) -> None:
    """``n`` choices: choice ``i`` is the single request seeded ``seed + i``, streamed or not,
    the later ones reading the first's prompt from the prefix cache; usage counts the prompt
    once and every choice's tokens."""
    client = server.openai()
    params: dict[str, Any] = dict(
        model="outrider-family", prompt="Once upon a time", max_tokens=10, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    alone = [client.completions.create(**params, seed=40 + i) for i in range(3)]
    # A prompt no request sent before: the later choices find the first's in the cache.
    with Client(server.daemon.endpoint) as zmq_client:
        before = zmq_client.server_info().prefix_cache_hits
        fresh = params | {"prompt": "Far over the misty mountains cold, to dungeons deep " * 8}
        client.completions.create(**fresh, seed=1, n=3)
        assert zmq_client.server_info().prefix_cache_hits == before + 2
    together = client.completions.create(**params, seed=40, n=3)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in together.choices}) > 1
    assert together.usage is not None and alone[0].usage is not None
    assert together.usage.completion_tokens == 30
    assert together.usage.prompt_tokens == alone[0].usage.prompt_tokens
    texts = ["", "", ""]
    finishes = [None, None, None]
    usage = None
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat = dict(model="outrider-family", messages=messages, max_tokens=8, temperature=1.0, seed=3)
    for chunk in client.chat.completions.create(
        **chat,
        n=3,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    full = client.chat.completions.create(**chat, n=3)  # type: ignore[arg-type]
    assert texts == [c.message.content for c in full.choices]
    assert finishes == [c.finish_reason for c in full.choices]
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_tokenize_round_trips_through_detokenize(server: HttpDaemon) -> None:
    prompt = "Once upon a time, the sea."
    tokenized = httpx.post(server.base + "/tokenize", json={"prompt": prompt}, headers=AUTH).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == 512
    # The daemon's own tokenization: a completion of the same prompt counts as many tokens.
    completion = server.openai().completions.create(
        model="outrider-family", prompt=prompt, max_tokens=1
    )
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == tokenized["count"]
    detokenized = httpx.post(
        server.base + "/detokenize", json={"tokens": tokenized["tokens"]}, headers=AUTH
    )
    assert detokenized.json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    chat_tokens = httpx.post(
        server.base + "/tokenize", json={"messages": messages}, headers=AUTH
    ).json()
    chat = server.openai().chat.completions.create(
        model="outrider-family",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == chat_tokens["count"]


def test_tokenize_refusals(server: HttpDaemon) -> None:
    for body in ({"tokens": [1, 8192]}, {"tokens": [-1]}, {"tokens": "x"}):
        refused = httpx.post(server.base + "/detokenize", json=body, headers=AUTH)
        assert refused.status_code == 400, body
        assert refused.json()["error"]["type"] == "invalid_request_error"
    both = {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}
    for body in ({}, both):
        assert httpx.post(server.base + "/tokenize", json=body, headers=AUTH).status_code == 400
    unknown = httpx.post(
        server.base + "/tokenize", json={"prompt": "a", "model": "gpt-4"}, headers=AUTH
    )
    assert unknown.status_code == 404


def test_the_key_covers_tokenize_and_its_scheme_is_case_insensitive(server: HttpDaemon) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [5]})):
        assert httpx.post(server.base + path, json=body).status_code == 401
        lower = {"Authorization": f"bearer {API_KEY}"}
        assert httpx.post(server.base + path, json=body, headers=lower).status_code == 200
    assert httpx.get(server.base + "/metrics").status_code == 401
    assert httpx.get(server.base + "/health/ready").status_code == 200


def test_hostile_bodies_are_400s_naming_the_field(server: HttpDaemon) -> None:
    for path, body, param in (
        ("/v1/completions", b'{"prompt": "\xff"}', None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3"}]}', None),
        ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', None),
        ("/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", "x"),
        ("/v1/completions", b'{"prompt": "a", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 18446744073709551616}', "max_tokens"),
        ("/v1/completions", b'{"prompt": [18446744073709551616]}', "prompt"),
        ("/detokenize", b'{"tokens": [18446744073709551616]}', "tokens"),
        ("/v1/completions", b'{"prompt": "a", "temperature": 1000}', "temperature"),
    ):
        answer = httpx.post(server.base + path, content=body, headers=AUTH)
        assert answer.status_code == 400, (body, answer.text)
        assert answer.json()["error"]["param"] == param, (body, answer.text)
    assert "Traceback" not in server.daemon.log()


class _Verdict(pydantic.BaseModel):
    verdict: Literal["yes", "no"]
    score: int = pydantic.Field(ge=0, le=9)
    reason: Literal["short", "long"]
    note: str = pydantic.Field(max_length=12)  # a bounded string: strict JSON too


def test_parse_with_a_pydantic_model_gets_an_instance(server: HttpDaemon) -> None:
    """``chat.completions.parse``: the client sends the model's strict JSON schema as
    ``response_format``; the daemon's output parses into the model, ending where it ends."""
    client = server.openai()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="outrider-family",
            messages=[{"role": "user", "content": "Was the sea calm?"}],
            response_format=_Verdict,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, _Verdict), choice.message.content


def test_regex_choice_and_grammar_outputs_match_streamed_or_not(server: HttpDaemon) -> None:
    client = server.openai()
    params = dict(model="outrider-family", prompt="Once upon a time", max_tokens=40, temperature=0)
    cases = [
        ({"structured_outputs": {"regex": "[a-c]{2}-[0-9]{3}"}}, r"[a-c]{2}-[0-9]{3}"),
        ({"guided_choice": ["sea", "land", "sky"]}, r"sea|land|sky"),
        ({"guided_grammar": 'root ::= "(" [xy] ("," [xy])* ")"'}, r"\([xy](,[xy])*\)"),
    ]
    for extra, pattern in cases:
        done = client.completions.create(**params, extra_body=extra)  # type: ignore[call-overload]
        assert re.fullmatch(pattern, done.choices[0].text), (extra, done.choices[0].text)
        assert done.choices[0].finish_reason == "stop"
        stream = client.completions.create(**params, extra_body=extra, stream=True)  # type: ignore[call-overload]
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == done.choices[0].text


def test_a_grammar_the_daemon_cannot_compile_is_a_400(server: HttpDaemon) -> None:
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(  # type: ignore[call-overload]
            model="outrider-family", prompt="a", extra_body={"guided_regex": "[0-9"}
        )
    assert "grammar (regex): Regex parsing error at position 5" in str(exc.value)
