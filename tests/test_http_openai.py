"""The HTTP front's pieces that need no daemon: ``--http`` settings, OpenAI requests
translated to ``generate`` arguments, hostile bodies refused as invalid requests, and the
body limit that keeps every request's frame under the daemon's."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from starlette.testclient import TestClient

from outrider.daemon.config import ConfigError
from outrider.daemon.family import embedded_family
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.http.config import (
    FRAME_HEADROOM,
    HttpFrontConfig,
    body_limit,
    parse_host_port,
)
from outrider.daemon.http.errors import split_path
from outrider.daemon.http.openai import (
    DAEMON_FIELDS,
    UNIMPLEMENTED,
    ChatRequest,
    CompletionRequest,
    InvalidRequest,
    chat_args,
    completion_args,
    decode_request,
)
from outrider.daemon.http.process import HEALTH_TIMEOUT_S, HttpFront
from outrider.daemon.http.tokenize import PIECE_CHARS, Tokenization
from outrider.protocol import AsyncClient, NotListening, RequestError
from outrider.protocol._client_common import GenerateCall
from outrider.protocol.frames import request_codec
from outrider.protocol.messages import MAX_TOKEN_ID, Grammar, Health, Tool

FAMILY = embedded_family()


def _resolve(*argv: str) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    resolve(parser.parse_args(["--model", "/nowhere", *argv]), environ={})


def test_http_flags_are_checked_when_resolved() -> None:
    _resolve("--http", "127.0.0.1:8000", "--api-key", "k", "--served-model-name", "m")
    _resolve("--http", "[::1]:0")
    _resolve("--http", "0.0.0.0:8000", "--http-allow-remote", "--api-key", "k")
    with pytest.raises(ConfigError, match="--http-allow-remote needs --api-key"):
        _resolve("--http", "0.0.0.0:8000", "--http-allow-remote")
    with pytest.raises(ConfigError, match="not a loopback address"):
        _resolve("--http", "0.0.0.0:8000")
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        _resolve("--http", "8000")
    with pytest.raises(ConfigError, match="need --http"):
        _resolve("--api-key", "k")
    assert parse_host_port("[::1]:8000") == ("::1", 8000)


def test_left_out_sampling_fields_stay_unset() -> None:
    args = completion_args(decode_request(b'{"prompt": "hi"}', CompletionRequest))
    assert (args.temperature, args.top_p, args.top_k, args.seed) == (None, None, None, None)
    assert args.max_new_tokens == 16 and args.logprobs == 0 and args.stop == []
    chat = chat_args(
        decode_request(
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],'
            b' "max_tokens": 5, "max_completion_tokens": 7, "top_k": 3, "stop": "x",'
            b' "logprobs": true}',
            ChatRequest,
        )
    )
    assert chat.messages == [{"role": "user", "content": "a"}]
    assert (chat.max_new_tokens, chat.top_k, chat.stop, chat.temperature) == (7, 3, ["x"], None)
    assert (chat.logprobs, chat.top_logprobs) == (1, 0)


def test_prompt_forms_and_refusals() -> None:
    ids = completion_args(decode_request(b'{"prompt": [[1, 2, 3]]}', CompletionRequest))
    assert ids.input_ids == [1, 2, 3] and ids.prompt is None
    for body, param in (
        (b'{"prompt": ["a", "b"]}', "prompt"),
        (b'{"prompt": "a", "n": 17}', "n"),
        (b'{"prompt": "a", "n": 0}', "n"),
        (b'{"prompt": "a", "logprobs": 21}', "logprobs"),
    ):
        with pytest.raises(InvalidRequest) as exc:
            completion_args(decode_request(body, CompletionRequest))
        assert exc.value.param == param
    with pytest.raises(InvalidRequest):
        decode_request(b'{"prompt": 5}', CompletionRequest)


# A value of each unimplemented field that asks for something, and one that asks for nothing.
_ASKING = {
    "min_tokens": (4, 0),
    "best_of": (2, 1),
    "suffix": ("x", ""),
    "functions": ([{"name": "f"}], []),
    "function_call": ("auto", "none"),
}


def _translate(body: dict[str, Any]) -> None:
    """``body`` decoded and translated as the route of its shape does it."""
    if "messages" in body:
        chat_args(decode_request(msgspec.json.encode(body), ChatRequest))
    else:
        completion_args(decode_request(msgspec.json.encode(body), CompletionRequest))


def test_every_unimplemented_field_is_refused_unless_it_asks_for_nothing() -> None:
    assert set(_ASKING) == set(UNIMPLEMENTED)
    for name, (asking, neutral) in _ASKING.items():
        for base in ({"prompt": "a"}, _CHAT):
            with pytest.raises(InvalidRequest, match=f"^{name} is not supported") as exc:
                _translate(base | {name: asking})
            assert (exc.value.status, exc.value.param) == (400, name)
            if neutral is not None:
                _translate(base | {name: neutral})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# Each spelling of structured output, and the grammar it becomes.
_STRUCTURED = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Grammar("json_object")),
    (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
        Grammar("json_schema", json.dumps(SCHEMA)),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, Grammar("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     Grammar("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, Grammar("regex", "a+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Grammar("choice", choices=["x", "y"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, Grammar("ebnf", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, Grammar("json_object")),
    ({"guided_json": SCHEMA}, Grammar("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]+"}, Grammar("regex", "[0-9]+")),
    ({"guided_choice": ["x"]}, Grammar("choice", choices=["x"])),
    ({"guided_grammar": 'root ::= "a"'}, Grammar("ebnf", 'root ::= "a"')),
    ({"guided_grammar": 'start: "a"'}, Grammar("lark", 'start: "a"')),
    ({"structured_outputs": {"grammar": "start: /[0-9]+/"}}, Grammar("lark", "start: /[0-9]+/")),
]  # fmt: skip


def test_structured_output_fields_become_one_grammar() -> None:
    for base in ({"prompt": "a"}, _CHAT):
        for fields, grammar in _STRUCTURED:
            body = msgspec.json.encode(base | fields)
            if "messages" in base:
                kwargs = chat_args(decode_request(body, ChatRequest)).client_kwargs()
            else:
                kwargs = completion_args(decode_request(body, CompletionRequest)).client_kwargs()
            assert kwargs.get("grammar") == grammar, fields


def test_a_draft_cap_goes_to_the_daemon_as_given() -> None:
    for base in ({"prompt": "a"}, _CHAT):
        for fields, cap in (({}, None), ({"max_drafts": 0}, 0), ({"max_drafts": 3}, 3)):
            body = msgspec.json.encode(base | fields)
            if "messages" in base:
                kwargs = chat_args(decode_request(body, ChatRequest)).client_kwargs()
            else:
                kwargs = completion_args(decode_request(body, CompletionRequest)).client_kwargs()
            assert kwargs["max_drafts"] == cap, fields


def test_structured_output_refusals_name_the_field() -> None:
    cases = [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
         "response_format and guided_regex both constrain the output: give one", "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
         "structured_outputs"),
        ({"structured_outputs": {}},
         "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
         "structured_outputs"),
        ({"response_format": {"type": "json_schema"}},
         "a json_schema response_format needs json_schema.schema", "response_format"),
        ({"guided_choice": ["a", ""]}, "guided_choice: a list of non-empty strings",
         "guided_choice"),
        ({"guided_json": "[1]"}, "guided_json: a JSON schema is an object", "guided_json"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs.json: not JSON: ",
         "structured_outputs.json"),
    ]  # fmt: skip
    for fields, message, param in cases:
        with pytest.raises(InvalidRequest) as exc:
            _translate(_CHAT | fields)
        assert str(exc.value).startswith(message) and exc.value.param == param, fields
    with pytest.raises(InvalidRequest) as exc:
        _translate(_CHAT | {"response_format": {"type": "xml"}})
    assert exc.value.param == "response_format.type"


def test_tools_go_to_the_daemon_and_only_with_chat() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": {"type": "object"}}}  # fmt: skip
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]  # fmt: skip
    body = {"messages": messages, "tools": [tool], "tool_choice": "required"}
    args = chat_args(decode_request(msgspec.json.encode(body), ChatRequest))
    kwargs = args.client_kwargs()
    assert kwargs["tools"] == [Tool("f", "d", '{"type": "object"}')]
    assert (kwargs["tool_choice"], kwargs["parallel_tool_calls"]) == ("required", True)
    assert kwargs["messages"][1] == {
        "role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "name": "f", "arguments": "{}"}]
    }  # fmt: skip
    assert kwargs["messages"][2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert args.calls_tools
    named = body | {"tool_choice": {"type": "function", "function": {"name": "f"}},
                    "parallel_tool_calls": False}  # fmt: skip
    kwargs = chat_args(decode_request(msgspec.json.encode(named), ChatRequest)).client_kwargs()
    assert (kwargs["tool_choice"], kwargs["tool_name"], kwargs["parallel_tool_calls"]) == (
        "required", "f", False)  # fmt: skip
    off = chat_args(
        decode_request(msgspec.json.encode(body | {"tool_choice": "none"}), ChatRequest)
    )
    assert not off.calls_tools and off.client_kwargs()["tool_choice"] == "none"
    plain = chat_args(decode_request(msgspec.json.encode(_CHAT), ChatRequest))
    assert "tools" not in plain.client_kwargs() and not plain.calls_tools
    with pytest.raises(InvalidRequest) as exc:
        _translate({"prompt": "a", "tools": [tool]})
    assert (str(exc.value), exc.value.param) == ("tools is not a field this server takes", "tools")


def test_logit_adjustments_go_to_the_daemon_as_given() -> None:
    given = {
        "presence_penalty": 2.0,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.2,
        "logit_bias": {"261": 100, "7": -5.5},
        "min_p": 0.1,
    }
    for base in ({"prompt": "a"}, _CHAT):
        body = msgspec.json.encode(base | given)
        if "messages" in base:
            kwargs = chat_args(decode_request(body, ChatRequest)).client_kwargs()
        else:
            kwargs = completion_args(decode_request(body, CompletionRequest)).client_kwargs()
        assert {name: kwargs[name] for name in given} == given | {"logit_bias": {261: 100, 7: -5.5}}
        left_out = completion_args(decode_request(b'{"prompt": "a"}', CompletionRequest))
        assert not set(given) & set(left_out.client_kwargs())
    with pytest.raises(InvalidRequest) as exc:
        decode_request(b'{"prompt": "a", "logit_bias": {"x": 1}}', CompletionRequest)
    assert exc.value.param == "logit_bias"


def test_stop_token_ids_go_to_the_daemon() -> None:
    body = b'{"prompt": "a", "stop_token_ids": [2, 7]}'
    assert completion_args(decode_request(body, CompletionRequest)).client_kwargs()[
        "stop_token_ids"
    ] == [2, 7]
    with pytest.raises(InvalidRequest) as exc:
        decode_request(b'{"prompt": "a", "stop_token_ids": [-1]}', CompletionRequest)
    assert exc.value.param == "stop_token_ids[0]"


def test_choice_i_draws_with_seed_plus_i() -> None:
    seeded = completion_args(
        decode_request(b'{"prompt": "a", "n": 3, "seed": 7}', CompletionRequest)
    )
    assert [kwargs["seed"] for kwargs in seeded.choice_kwargs()] == [7, 8, 9]
    assert seeded.choice_kwargs()[1] == seeded.client_kwargs() | {"seed": 8}
    unseeded = chat_args(decode_request(msgspec.json.encode(_CHAT | {"n": 2}), ChatRequest))
    assert [kwargs["seed"] for kwargs in unseeded.choice_kwargs()] == [None, None]


def test_unknown_fields_are_refused_by_name() -> None:
    for base in ({"prompt": "a"}, _CHAT):
        with pytest.raises(InvalidRequest, match=r"^temprature is not a field") as exc:
            _translate(base | {"temprature": 0.5})
        assert (exc.value.status, exc.value.param) == (400, "temprature")
        _translate(base | {"user": "someone"})


_CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "a"}]}


# Bodies that once raised past the routes (a 500 and a traceback each): each must be a 400.
_HOSTILE_BODIES = {
    b'{"prompt": "\xff\xfe"}': None,
    b'{"model": "\xc3", "prompt": "a"}': None,
    b'{"prompt": "a", "unknown": ' + b"[" * 1000 + b"]" * 1000 + b"}": "unknown",
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}": None,
    b'{"prompt": "a", "seed": 18446744073709551616}': "seed",
    b'{"prompt": "a", "max_tokens": 18446744073709551616}': "max_tokens",
    b'{"prompt": "a", "top_k": -1}': "top_k",
    b'{"prompt": [1, 18446744073709551616]}': "prompt",
    b'{"prompt": [1, -2]}': "prompt",
    b'{"prompt": "a", "stream": "yes"}': "stream",
}


@pytest.mark.parametrize("body", list(_HOSTILE_BODIES))
def test_hostile_completion_bodies_are_invalid_requests(body: bytes) -> None:
    with pytest.raises(InvalidRequest) as exc:
        completion_args(decode_request(body, CompletionRequest))
    assert exc.value.status == 400 and exc.value.param == _HOSTILE_BODIES[body]


def test_hostile_chat_bodies_name_the_openai_field() -> None:
    bad_content = b'{"messages": [{"role": "user", "content": "\xff"}]}'
    with pytest.raises(InvalidRequest, match="UTF-8"):
        decode_request(bad_content, ChatRequest)
    wrong = b'{"messages": [{"role": "user", "content": 5}]}'
    with pytest.raises(InvalidRequest) as exc:
        decode_request(wrong, ChatRequest)
    assert exc.value.param == "messages[0].content"
    assert "`$.messages[0].content`" in str(exc.value)


def test_daemon_field_names_become_the_openai_names() -> None:
    message = "Expected `int` >= 0 - at `$.max_new_tokens`"
    assert split_path(message, DAEMON_FIELDS) == (
        "Expected `int` >= 0 - at `$.max_tokens`",
        "max_tokens",
    )
    chat = DAEMON_FIELDS | {"max_new_tokens": "max_completion_tokens"}
    assert split_path(message, chat)[1] == "max_completion_tokens"
    assert split_path("Expected `int` - at `$.input_ids[3]`", DAEMON_FIELDS)[1] == "prompt[3]"
    assert split_path("the daemon is draining") == ("the daemon is draining", None)


def test_a_body_at_the_limit_fits_in_one_client_frame() -> None:
    """Every field reaches the frame at most as long as its JSON, so a body of the derived
    limit, whatever fills it, gives a frame under --max-message-bytes."""
    max_message_bytes = 2**20
    limit = body_limit(max_message_bytes)
    codec = request_codec()
    rng = random.Random(7)
    ids = [rng.randrange(MAX_TOKEN_ID) for _ in range(limit // 11)]
    fillers: list[Any] = [
        {"prompt": "é\x00\\" * (limit // 12)},
        {"prompt": ids},
        {"prompt": "a", "stop": ["xy"] * (limit // 6)},
    ]
    for filler in fillers:
        body = msgspec.json.encode(filler | {"max_tokens": MAX_TOKEN_ID, "seed": 2**63 - 1})
        assert len(body) <= limit
        args = completion_args(decode_request(body, CompletionRequest))
        frame = codec.encode(GenerateCall(**args.client_kwargs()).request(stream=True))
        assert len(frame) <= len(body) + FRAME_HEADROOM // 64 <= max_message_bytes
    chat = msgspec.json.encode(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}] * 9000}] * 3}
    )
    chat_args_ = chat_args(decode_request(chat, ChatRequest))
    frame = codec.encode(GenerateCall(**chat_args_.client_kwargs()).request(stream=False))
    assert len(frame) <= len(chat)


def test_http_limit_flags() -> None:
    _resolve("--http", "127.0.0.1:1", "--http-max-body-bytes", "1000", "--http-read-timeout", "5")
    _resolve("--http", "127.0.0.1:1", "--http-allow-origins", "http://a.example,https://b:8443")
    for argv, problem in (
        (("--http-max-body-bytes", str(8 * 2**20)), "--http-max-body-bytes must be in"),
        (("--http-read-timeout", "0"), "must be > 0"),
        (("--http-max-connections", "0"), "must be >= 1"),
        (("--http-allow-origins", "*"), "expected scheme://host"),
        (("--http-allow-origins", "http://a.example/path"), "expected scheme://host"),
    ):
        with pytest.raises(ConfigError, match=problem):
            _resolve("--http", "127.0.0.1:1", *argv)
    with pytest.raises(ConfigError, match="need --http"):
        _resolve("--http-read-timeout", "5")


def test_errors_do_not_name_the_daemon_endpoint() -> None:
    from outrider.daemon.http.process import request_error_response
    from outrider.protocol import RequestError

    for code in ("connection_lost", "timeout"):
        exc = RequestError(code, "no answer from ipc:///run/user/1000/outrider/o.sock")
        answer = request_error_response(exc)
        assert answer.status_code == 503 and b"ipc://" not in answer.body
        assert b"/run/" not in answer.body


@pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed")
def test_tokenize_work_is_bounded_by_the_limit() -> None:
    """An 8 MB /tokenize or /detokenize body over the limit is refused after a bounded part of
    it (it once took seconds and hundreds of MB); a text at the limit is still answered."""
    assert FAMILY is not None
    rng = random.Random(3)
    words = ["the", "sea", "ships", "  ", "\n", "ééé", "x1y2", "gulls"]
    text = " ".join(rng.choice(words) for _ in range(40_000))
    count = len(Tokenization(str(FAMILY.target), 10**6)._tokenize(_prompt(text), _any_model))
    assert len(text) > 2 * PIECE_CHARS and count > 20_000
    assert (
        len(Tokenization(str(FAMILY.target), count)._tokenize(_prompt(text), _any_model)) == count
    )
    with pytest.raises(InvalidRequest, match="more than"):
        Tokenization(str(FAMILY.target), count - 1)._tokenize(_prompt(text), _any_model)
    huge = _prompt(" ".join(rng.choice(words) for _ in range(1_900_000)))
    assert len(huge) > 8_000_000
    bounded = Tokenization(str(FAMILY.target), 4096)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="more than 4096 tokens"):
        bounded._tokenize(huge, _any_model)
    ids = msgspec.json.encode({"tokens": [5] * 4_000_000})
    with pytest.raises(InvalidRequest, match="more than 4096 tokens"):
        bounded._detokenize(ids, _any_model)
    assert time.monotonic() - started < 2.0


def _prompt(text: str) -> bytes:
    return msgspec.json.encode({"prompt": text})


def _any_model(_model: str | None) -> None:
    pass


class _Daemon:
    """The daemon as the HTTP front's client sees it: ``answers`` in turn, each after
    ``delay_s`` (a client whose endpoint nobody binds raises only once its timeout passes)."""

    def __init__(self, answers: list[Health | RequestError], delay_s: float = 0.0) -> None:
        self.answers = answers
        self.delay_s = delay_s

    async def health(self, timeout: float) -> Health:
        await asyncio.sleep(min(self.delay_s, timeout))
        answer = self.answers.pop(0)
        if isinstance(answer, RequestError):
            raise answer
        return answer


SERVING = Health("h", "serving", "boot", "0.1.0", 1)
DOES_NOT_ANSWER = "the daemon does not answer: the daemon did not answer in time"


def _front(endpoint: str, daemon: _Daemon) -> TestClient:
    cfg = HttpFrontConfig(
        host="127.0.0.1", port=8000, client_endpoint=endpoint, served_model_name="m",
        version="0.1.0", model_dir=None, max_message_bytes=1 << 20, max_body_bytes=1 << 19,
        max_tokenize_tokens=16, read_timeout_s=5.0, send_timeout_s=5.0, max_connections=4,
    )  # fmt: skip
    front = HttpFront(cfg, cast(AsyncClient, daemon))
    return TestClient(front.app(), base_url="http://127.0.0.1:8000")


def test_health_says_loading_at_once_while_the_lock_holds_a_loading_daemon(
    tmp_path: Path,
) -> None:
    """An ipc:// daemon holds ``PATH.lock`` with its pid while it loads and binds ``PATH``
    only then: the front answers "loading" without waiting on the socket."""
    socket = tmp_path / "outrider.sock"
    (tmp_path / "outrider.sock.lock").write_text(f"{os.getpid()}\n")
    daemon = _Daemon([SERVING], delay_s=HEALTH_TIMEOUT_S)
    with _front(f"ipc://{socket}", daemon) as http:
        for path in ("/health", "/health/ready"):
            started = time.monotonic()
            loading = http.get(path)
            assert time.monotonic() - started < HEALTH_TIMEOUT_S / 4
            assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
        assert daemon.answers == [SERVING]  # not asked
        socket.touch()  # the front door has bound it
        daemon.delay_s = 0.0
        serving = http.get("/health/ready")
    assert (serving.status_code, serving.json()) == (200, {"status": "serving"})


def test_without_a_live_lock_nothing_listening_is_no_daemon(tmp_path: Path) -> None:
    (tmp_path / "outrider.sock.lock").write_text("0\n")  # released by a daemon that exited
    daemon = _Daemon([NotListening("no daemon is listening")])
    with _front(f"ipc://{tmp_path / 'outrider.sock'}", daemon) as http:
        none = http.get("/health")
    assert none.status_code == 503
    assert none.json()["error"]["message"] == DOES_NOT_ANSWER


def test_health_says_loading_until_the_daemon_first_answers() -> None:
    """Where no lock file tells (tcp://), nothing listening before the daemon's first answer
    is loading; after it, a lost daemon."""
    daemon = _Daemon(
        [NotListening("nothing listens yet"), SERVING, NotListening("nothing listens any more")]
    )
    with _front("tcp://127.0.0.1:5555", daemon) as http:
        loading = http.get("/health/ready")
        assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
        serving = http.get("/health")
        assert (serving.status_code, serving.json()) == (200, {"status": "serving"})
        lost = http.get("/health")
    assert lost.status_code == 503
    assert lost.json()["error"]["message"] == DOES_NOT_ANSWER
