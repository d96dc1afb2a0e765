"""The HTTP front's pieces that need no daemon: ``--http`` settings, and OpenAI requests
translated to ``generate`` arguments."""

from __future__ import annotations

import argparse

import pytest

from outrider.daemon.config import ConfigError, add_serve_arguments, resolve
from outrider.daemon.http_config import parse_host_port
from outrider.daemon.http_openai import (
    ChatRequest,
    CompletionRequest,
    InvalidRequest,
    chat_args,
    completion_args,
    decode_request,
)


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
        (b'{"prompt": "a", "n": 2}', "n"),
        (b'{"prompt": "a", "logprobs": 21}', "logprobs"),
    ):
        with pytest.raises(InvalidRequest) as exc:
            completion_args(decode_request(body, CompletionRequest))
        assert exc.value.param == param
    with pytest.raises(InvalidRequest):
        decode_request(b'{"prompt": 5}', CompletionRequest)
