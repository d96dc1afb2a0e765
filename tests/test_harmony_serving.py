"""A gpt-oss model served end to end in the harmony format: its chat outputs split into answer,
reasoning and tool calls for the client library and the OpenAI API, and what cannot act on a
split output refused. The model is scripted (o200k_fixture.py): whatever the chat, it calls
``get_weather`` in harmony's own format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import openai
import pydantic
import pytest
from http_harness import API_KEY, HttpDaemon
from o200k_fixture import o200k_vocab_dir, save_scripted_gpt_oss

from outrider.daemon.harmony import load_encoding_from
from outrider.protocol import Client, Grammar, RequestError

CALL = (
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = '<|channel|>final<|message|>{"city": "Paris"}<|return|>'


def scripted(tokenizer_dir: Path, factory: pytest.TempPathFactory, text: str) -> Path:
    """A scripted gpt-oss (o200k_fixture.py) whose greedy output for any chat is ``text``."""
    output = load_encoding_from(o200k_vocab_dir()).encode(text, allowed_special="all")
    return save_scripted_gpt_oss(tokenizer_dir, factory.mktemp("scripted-gpt-oss"), output)


@pytest.fixture(scope="module")
def model_dir(gpt_oss_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted(gpt_oss_tokenizer_dir, tmp_path_factory, CALL)


@pytest.fixture(scope="module")
def answering_model(gpt_oss_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scripted model that answers every chat with ``ANSWER``."""
    return scripted(gpt_oss_tokenizer_dir, tmp_path_factory, ANSWER)


@pytest.fixture(scope="module")
def servers(
    model_dir: Path, answering_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[HttpDaemon, HttpDaemon]]:
    """Daemons serving ``model_dir`` and ``answering_model`` over HTTP, started together (a
    start-up is mostly its front door loading the o200k tokenizer on one core), stopped
    cleanly after the module's tests."""
    started: list[HttpDaemon] = []
    try:
        for model in (model_dir, answering_model):
            workdir = tmp_path_factory.mktemp("harmony-http")
            started.append(HttpDaemon(workdir, "--api-key", API_KEY, model=model, wait=False))
        for http in started:
            http.wait_up()
        yield started[0], started[1]
        for http in started:
            assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        for http in started:
            http.daemon.kill_all()


@pytest.fixture(scope="module")
def server(servers: tuple[HttpDaemon, HttpDaemon]) -> HttpDaemon:
    return servers[0]


@pytest.fixture(scope="module")
def answering(servers: tuple[HttpDaemon, HttpDaemon]) -> HttpDaemon:
    return servers[1]


def test_the_client_library_gets_the_call_apart_from_the_answer(server: HttpDaemon) -> None:
    with Client(server.daemon.endpoint, timeout=60) as client:
        assert client.server_info().configuration["output_format"] == "harmony"
        result = client.generate(messages=MESSAGES, temperature=0, max_new_tokens=40)
        assert (result.text, result.reasoning, result.finish_reason) == ("", "", "stop")
        assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert result.tool_calls[0].id.startswith("call_")
        stream = client.stream(messages=MESSAGES, temperature=0, max_new_tokens=40)
        chunks = list(stream)
        assert stream.result is not None
        assert [c for chunk in chunks for c in chunk.tool_calls] == stream.result.tool_calls
        assert [(c.name, c.arguments) for c in stream.result.tool_calls] == [
            (c.name, c.arguments) for c in result.tool_calls
        ]
        # A prompt is not a chat: its text is the tokens' (special tokens skipped).
        raw = client.generate(
            input_ids=[result.output_ids[0], 173_781], temperature=0, max_new_tokens=40,
            stop=["Paris"],
        )  # fmt: skip
        assert raw.tool_calls == [] and raw.reasoning == ""
        assert raw.text.startswith("commentary to=functions.get_weather json")


def test_stop_strings_of_a_chat_are_refused(server: HttpDaemon) -> None:
    with Client(server.daemon.endpoint, timeout=60) as client:
        with pytest.raises(RequestError) as refused:
            client.generate(messages=MESSAGES, max_new_tokens=8, stop=["Paris"])
        assert refused.value.code == "unsupported"
        assert "harmony format" in refused.value.message


def test_the_openai_client_gets_the_call_streamed_or_not(
    server: HttpDaemon, model_dir: Path
) -> None:
    client = server.openai()
    params = dict(model=model_dir.name, messages=MESSAGES, max_tokens=40, temperature=0)
    done = client.chat.completions.create(**params)  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"}
    )  # fmt: skip
    stream = client.chat.completions.create(**params, stream=True)  # type: ignore[call-overload]
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    calls = [c for d in deltas for c in d.delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError, match="harmony format"):
        client.chat.completions.create(**params, stop=["Paris"])  # type: ignore[call-overload]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}},
                   "required": ["zone"]}}}  # fmt: skip


def test_tools_and_reasoning_effort_are_rendered_and_a_result_goes_back(
    server: HttpDaemon, model_dir: Path
) -> None:
    """The prompt's size shows what was rendered: the tools (the developer message) and the
    call and its result of the follow-up."""
    client = server.openai()
    params = dict(model=model_dir.name, max_tokens=40, temperature=0, tools=[WEATHER])
    bare = client.chat.completions.create(  # type: ignore[call-overload]
        **params | {"tools": None}, messages=MESSAGES
    )
    done = client.chat.completions.create(  # type: ignore[call-overload]
        **params, messages=MESSAGES, reasoning_effort="high"
    )
    assert done.usage.prompt_tokens > bare.usage.prompt_tokens + 30  # the tools' namespace
    (call,) = done.choices[0].message.tool_calls
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 20}'},
    ]
    again = client.chat.completions.create(**params, messages=follow_up)  # type: ignore[call-overload]
    assert again.usage.prompt_tokens > done.usage.prompt_tokens + 20  # the call and result
    required = client.chat.completions.create(  # type: ignore[call-overload]
        **params, messages=MESSAGES, tool_choice="required"
    )
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
    # Named, the call is held to that tool and its schema where the model would call another.
    named = client.chat.completions.create(  # type: ignore[call-overload]
        **params | {"tools": [WEATHER, CLOCK], "max_tokens": 120}, messages=MESSAGES,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "UTC"},
    )
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]: its tool_call_id"):
        client.chat.completions.create(  # type: ignore[call-overload]
            **params, messages=[*MESSAGES, {"role": "tool", "tool_call_id": "x", "content": ""}]
        )


class Lyon(pydantic.BaseModel):
    city: Literal["Lyon"]


def test_a_grammar_holds_a_chats_final_answer_and_a_prompts_whole_output(
    answering: HttpDaemon, answering_model: Path
) -> None:
    with Client(answering.daemon.endpoint, timeout=60) as client:
        free = client.generate(messages=MESSAGES, temperature=0, max_new_tokens=40)
        assert (free.text, free.reasoning, free.finish_reason) == ('{"city": "Paris"}', "", "stop")
        schema = json.dumps(Lyon.model_json_schema())
        held = client.generate(
            messages=MESSAGES, temperature=0, max_new_tokens=60,
            grammar=Grammar("json_schema", schema),
        )  # fmt: skip
        assert (held.text, held.finish_reason) == ('{"city": "Lyon"}', "stop")
        # A prompt is not a chat: its grammar holds the whole output, format tokens barred.
        raw = client.generate(
            prompt="Hi", temperature=0, max_new_tokens=20, grammar=Grammar("regex", "Lyon")
        )
        assert (raw.text, raw.finish_reason) == ("Lyon", "stop")
    parsed = answering.openai().chat.completions.parse(
        model=answering_model.name, messages=MESSAGES, max_tokens=60, temperature=0,
        response_format=Lyon,
    )  # fmt: skip
    assert parsed.choices[0].message.parsed == Lyon(city="Lyon")
