"""Tools (daemon/grammar/tool_calls.py, frontdoor/tools.py, the daemon's tool grammar): the format a
chat template speaks, calls parsed out of outputs in both formats, the front door's refusals
and the template's rendering of tools and tool messages, and through the in-process engine
(a tiny random llama, a tokenizer with a Hermes-style template): ``required`` and named calls
always come, each call's arguments valid under its tool's schema, one call where parallel
calls are off; the same tokens under speculation as without."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_model_fixture import CHAT_VOCAB, chat_tokenizer, save_chat_model
from engine_harness import debug_checks_fixture, engine_for, request, run
from http_harness import API_KEY, HttpDaemon
from model_fixtures import save_drafts

from outrider.daemon.frontdoor.tools import ToolsRefused, template_inputs, tool_use
from outrider.daemon.grammar.compiler import Grammars
from outrider.daemon.grammar.tool_calls import tool_call_format
from outrider.daemon.http.tools import CallStream
from outrider.daemon.internal import TokenizedRequest, ToolUse
from outrider.daemon.tokenizer import Tokenizer
from outrider.protocol import ParsedCall, parse_tool_calls
from outrider.protocol.messages import ChatMessage, Generate, Grammar, Tool, ToolCall

debug_checks = debug_checks_fixture()

VOCAB = CHAT_VOCAB
# Chat templates written for these tests in the two formats' styles.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for tool in tools %}\n{{ tool.function | tojson }}"
    '{% endfor %}\nCall one as <tool_call>\n{"name": N, "arguments": A}\n</tool_call></s>'
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response></s>"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}</s>"
    "{% else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LLAMA_TEMPLATE = (
    '{% if tools %}<|system|>Answer with {"name": N, "parameters": A}:'
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    json.dumps({
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }),
)  # fmt: skip
CLOCK = Tool(
    "get_time",
    "The time in a zone",
    json.dumps({
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    }),
)  # fmt: skip
PROMPTS = [[1, 17, 40, 99, 7], [1, 5, 6, 200, 31, 77, 3], [1, 250, 12]]


def test_the_format_comes_from_the_chat_template() -> None:
    assert tool_call_format(HERMES_TEMPLATE) == "qwen_3"
    assert tool_call_format(LLAMA_TEMPLATE) == "llama"
    assert tool_call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_call_format(None) is None


def test_calls_are_parsed_out_of_both_formats() -> None:
    hermes = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        "<tool_call>not json</tool_call>"
    )
    content, calls = parse_tool_calls("qwen_3", hermes)
    assert calls == [
        ParsedCall("get_weather", {"city": "Oslo", "days": 2}),
        ParsedCall("get_time", {}),
    ]
    assert content == "Let me look.\n<tool_call>not json</tool_call>"
    llama = '{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}'
    assert parse_tool_calls("llama", llama) == (
        "",
        [ParsedCall("get_weather", {"city": "Lima", "days": 1})],
    )
    plain = 'The {"name": tag} is not a call.'
    assert parse_tool_calls("llama", plain) == (plain, [])


def test_a_stream_sends_content_until_a_call_begins_then_each_call_as_it_is_written() -> None:
    stream = CallStream("qwen_3")
    pieces = [
        stream.take(t)
        for t in [
            "Let me ",
            "check.<tool",  # "<tool" may begin a call: held
            "_call>\n",
            '{"name": "get_time", ',
            '"arguments": {"zone": "U',
            'TC", "at": [1, {"x": "}\\""}]}}\n</tool_call>',
            " Done.",
        ]
    ]
    assert [content for content, _ in pieces] == ["Let me", " check.", "", "", "", "", "Done."]
    calls = [call for _, called in pieces for call in called]
    head, rest = calls[0], calls[1:]
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert head["index"] == 0
    assert head["function"] == {"name": "get_time", "arguments": '{"zone": "U'}
    assert rest == [{"index": 0, "function": {"arguments": 'TC", "at": [1, {"x": "}\\""}]}'}}]
    arguments = "".join(call["function"]["arguments"] for call in calls)
    assert json.loads(arguments) == {"zone": "UTC", "at": [1, {"x": '}"'}]}
    assert stream.finish() == ("", []) and stream.calls == 1
    # A second call gets the next index; whitespace after a call is not content.
    assert stream.take('\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n')[0] == ""
    assert stream.calls == 2
    plain = CallStream("qwen_3")
    assert [plain.take(t) for t in ["a <to", "y> b\n"]] == [("a", []), (" <toy> b", [])]
    assert plain.finish() == ("\n", []) and plain.calls == 0  # no call: the text as written
    llama = CallStream("llama")
    content, [call] = llama.take('Sure. {"name": "get_time", "parameters": {"zone": "CET"}}')
    assert content == "Sure." and call["function"] == {
        "name": "get_time", "arguments": '{"zone": "CET"}'
    }  # fmt: skip
    # A call's start that never makes a head is parsed with the rest at the end.
    text = CallStream("llama")
    assert text.take('The {"name": tag} is not a call.') == ("The", [])
    assert text.finish() == (' {"name": tag} is not a call.', [])
    cut = CallStream("qwen_3")  # ended inside its arguments (max_tokens): sent as written
    assert cut.take('<tool_call>\n{"name": "b", "arguments": {"a": ')[1][0]["index"] == 0
    assert cut.finish() == ("", []) and cut.calls == 1


def _chat(**fields: object) -> Generate:
    return Generate("r", messages=[ChatMessage("user", "Weather?")], **fields)  # type: ignore[arg-type]


def test_the_front_door_refuses_what_it_cannot_honour() -> None:
    cases = [
        (_chat(tool_choice="required"), "tool_choice required needs tools"),
        (_chat(tools=[WEATHER], tool_name="get_weather"), "tool_name needs tool_choice required"),
        (_chat(tools=[WEATHER], tool_choice="required", tool_name="nope"),
         "tool_name 'nope' is not one of tools"),
        (_chat(tools=[WEATHER, WEATHER]), "tools: two tools have the same name"),
        (_chat(tools=[Tool("f", parameters="[1]")]), "tools[0].parameters: not a JSON object"),
        (Generate("r", prompt="x", tools=[WEATHER]), "tools need a chat request (messages)"),
        (_chat(tools=[WEATHER], grammar=Grammar("json_object")),
         "a grammar and tools cannot both constrain one output"),
        (Generate("r", messages=[ChatMessage("assistant", "", [ToolCall("c", "f", "{")])]),
         "messages[0].tool_calls[0].arguments: not JSON"),
    ]  # fmt: skip
    for msg, message in cases:
        with pytest.raises(ToolsRefused) as refused:
            tool_use(msg, "qwen_3")
        assert str(refused.value).startswith(message), str(refused.value)
    with pytest.raises(ToolsRefused, match="renders no tool-call format") as exc:
        tool_use(_chat(tools=[WEATHER]), None)
    assert exc.value.code == "unsupported"
    assert tool_use(_chat(tools=[WEATHER], tool_choice="none"), None) is None
    named = _chat(tools=[WEATHER], tool_choice="required", tool_name="get_weather")
    assert tool_use(named, "llama") == ToolUse("llama", [WEATHER], "required", "get_weather", True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tools-llama")
    # A context that holds the tools' schemas, a byte a token.
    save_chat_model(directory, chat_template=HERMES_TEMPLATE, context=1024)
    return directory


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return chat_tokenizer(model_dir)


def test_the_template_renders_tools_calls_and_results(tokenizer: Tokenizer) -> None:
    msg = Generate(
        "r",
        messages=[
            ChatMessage("user", "Weather in Oslo?"),
            ChatMessage("assistant", "", [ToolCall("c1", "get_weather", '{"city": "Oslo"}')]),
            ChatMessage("tool", "cold", tool_call_id="c1"),
        ],
        tools=[WEATHER],
    )
    turns, tools = template_inputs(msg)
    text = tokenizer.hf.decode(tokenizer.apply_chat_template(turns, tools))
    assert '"name": "get_weather"' in text and '"description": "The weather in a city"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    )
    assert "<tool_response>cold</tool_response>" in text
    assert text.endswith("<|assistant|>")


def _requests(use: ToolUse) -> list[TokenizedRequest]:
    return [
        request(i, prompt, max_new_tokens=120, ignore_eos=False, temperature=1.0, seed=i)
        for i, prompt in enumerate(PROMPTS)
    ]


def _with_tools(reqs: list[TokenizedRequest], use: ToolUse) -> list[TokenizedRequest]:
    return [TokenizedRequest(**{f: getattr(r, f) for f in r.__struct_fields__} | {"tools": use})
            for r in reqs]  # fmt: skip


def _calls(outcomes: dict, tokenizer: Tokenizer) -> list[list[ParsedCall]]:
    """Each output's calls (text may follow them: a random model rambles to its length)."""
    found = []
    for rid in sorted(outcomes):
        tokens = outcomes[rid].token_ids
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            tokens = tokens[:-1]
        found.append(parse_tool_calls("qwen_3", tokenizer.hf.decode(tokens))[1])
    return found


def _valid(call: ParsedCall) -> bool:
    if call.name == "get_weather":
        args = call.arguments
        return (
            set(args) == {"city", "days"}
            and args["city"] in ("Paris", "Oslo", "Lima")
            and (args["days"] in range(1, 8))
        )
    return call.name == "get_time" and call.arguments.get("zone") in ("UTC", "CET")


@pytest.mark.parametrize(
    ("use", "names"),
    [
        (ToolUse("qwen_3", [WEATHER, CLOCK], "required", None, True), {"get_weather", "get_time"}),
        (ToolUse("qwen_3", [WEATHER, CLOCK], "required", "get_time", True), {"get_time"}),
        (ToolUse("qwen_3", [WEATHER, CLOCK], "required", None, False), {"get_weather", "get_time"}),
    ],
    ids=["required", "named", "one call"],
)
def test_required_calls_come_and_hold_to_their_schemas(
    model_dir: Path, tokenizer: Tokenizer, use: ToolUse, names: set[str]
) -> None:
    assert tokenizer.eos_token_id is not None
    grammars = Grammars(str(model_dir), VOCAB, [tokenizer.eos_token_id])
    outcomes = run(engine_for(str(model_dir)), _with_tools(_requests(use), use), grammars=grammars)
    for calls in _calls(outcomes, tokenizer):
        assert calls and all(_valid(c) and c.name in names for c in calls), calls
        if not use.parallel:
            assert len(calls) == 1


def test_tool_calls_under_speculation_are_the_plain_engines(
    model_dir: Path, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert tokenizer.eos_token_id is not None
    grammars = Grammars(str(model_dir), VOCAB, [tokenizer.eos_token_id])
    drafts = save_drafts(tmp_path_factory.mktemp("tools-drafts"), model_dir)
    use = ToolUse("qwen_3", [WEATHER, CLOCK], "auto", None, True)
    reqs = _with_tools(_requests(use), use)
    plain = run(engine_for(str(model_dir), no_overlap=True), reqs, grammars=grammars)
    spec = run(
        engine_for(str(model_dir), speculative_algorithm="eagle3", speculative_num_steps=3,
                   draft_model=drafts["eagle3"]),
        reqs,
        grammars=grammars,
    )  # fmt: skip
    for rid, outcome in plain.items():
        assert spec[rid].token_ids == outcome.token_ids
    for calls in _calls(spec, tokenizer):
        assert all(_valid(c) for c in calls)


@pytest.fixture(scope="module")
def http_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    http = HttpDaemon(tmp_path_factory.mktemp("tools-http"), "--api-key", API_KEY, model=model_dir)
    try:
        yield http
        assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        http.daemon.kill_all()


OPENAI_TOOLS = [
    {"type": "function",
     "function": {"name": t.name, "description": t.description,
                  "parameters": json.loads(t.parameters)}}
    for t in (WEATHER, CLOCK)
]  # fmt: skip


@pytest.mark.e2e
def test_the_openai_client_gets_tool_calls_streamed_or_not(
    http_server: HttpDaemon, model_dir: Path
) -> None:
    client = http_server.openai()
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    params = dict(model=model_dir.name, messages=messages, tools=OPENAI_TOOLS, max_tokens=120,
                  temperature=1.0, seed=3)  # fmt: skip
    done = client.chat.completions.create(**params, tool_choice="required")  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert _valid(ParsedCall(call.function.name, json.loads(call.function.arguments)))
        assert call.id.startswith("call_") and call.type == "function"
    named = client.chat.completions.create(  # type: ignore[call-overload]
        **params, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert {c.function.name for c in named.choices[0].message.tool_calls or []} == {"get_time"}
    stream = client.chat.completions.create(**params, tool_choice="required", stream=True)  # type: ignore[call-overload]
    deltas = [chunk.choices[0] for chunk in stream if chunk.choices]
    # Each call's head (id, name) first, then its arguments in pieces, under its index.
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for call in (c for d in deltas for c in d.delta.tool_calls or []):
        if call.id is not None:
            assert call.function is not None and call.function.name
            names[call.index] = call.function.name
        assert call.function is not None
        arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    # The call and its result go back in: the template renders them, the model answers.
    call = choice.message.tool_calls[0]
    follow_up = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "cold"},
    ]
    answer = client.chat.completions.create(**params | {"messages": follow_up}, tool_choice="none")  # type: ignore[call-overload]
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
