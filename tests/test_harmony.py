"""daemon/harmony.py: the harmony encoding loaded from a gpt-oss tokenizer without a download,
and outputs split into answer, reasoning and tool calls, whatever their tokens' grouping."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from frontdoor_harness import model_facts
from o200k_fixture import O200K_SHA256, VOCAB_SIZE, o200k_vocab_dir

from outrider.daemon.frontdoor.requests import LiveRequest
from outrider.daemon.frontdoor.validation import Rejected, Validator
from outrider.daemon.grammar.tool_calls import HARMONY
from outrider.daemon.harmony import (
    ChannelDelta,
    ChannelSplit,
    HarmonyRefused,
    harmony_encoding,
    load_encoding_from,
    render_chat,
    tiktoken_vocab,
)
from outrider.daemon.http.responses import Shape, TokenTexts
from outrider.daemon.internal import FinishInfo, RequestUpdate, ToolUse
from outrider.daemon.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from outrider.protocol import GenerateResult, TokenChunk
from outrider.protocol.messages import (
    ChatMessage,
    Chunk,
    Finished,
    Generate,
    Grammar,
    Tool,
    ToolCall,
    Usage,
    request_revision,
)
from outrider.protocol.tool_calls import ParsedCall


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    return o200k_vocab_dir()


@pytest.fixture(scope="module")
def gpt_oss_tokenizer(gpt_oss_tokenizer_dir: Path) -> Tokenizer:
    tokenizer = load_tokenizer(gpt_oss_tokenizer_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def encoding(vocab_dir: Path) -> Any:
    return load_encoding_from(vocab_dir)


def test_the_vocabulary_written_from_the_tokenizer_is_o200k_byte_for_byte(
    gpt_oss_tokenizer: Tokenizer,
) -> None:
    vocab = tiktoken_vocab(gpt_oss_tokenizer)
    assert hashlib.sha256(vocab).hexdigest() == O200K_SHA256
    assert vocab.count(b"\n") == 199_998


def test_the_encoding_loads_from_the_tokenizer_alone(
    gpt_oss_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    encoding = harmony_encoding(gpt_oss_tokenizer)
    assert encoding.encode("<|start|>assistant<|channel|>", allowed_special="all") == [
        200006, 173781, 200005,
    ]  # fmt: skip
    assert encoding.decode_utf8([200002, 200012]) == "<|return|><|call|>"


def test_a_tokenizer_that_is_not_o200k_is_refused(tmp_path: Path) -> None:
    """A byte-level tokenizer of 256 tokens: its file is well formed, but not o200k's."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = sorted(bytes_to_unicode().items())
    backend = BackendTokenizer(models.BPE({char: byte for byte, char in chars}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer is not None
    vocab = tiktoken_vocab(tokenizer)
    assert vocab.splitlines()[65] == base64.b64encode(b"A") + b" 65"
    with pytest.raises(HarmonyRefused, match=r"vocabulary is not o200k's: .*hash mismatch"):
        harmony_encoding(tokenizer)


def tokens(encoding: Any, text: str) -> list[int]:
    return list(encoding.encode(text, allowed_special="all"))


def split_whole(encoding: Any, ids: list[int]) -> ChannelDelta:
    split = ChannelSplit(encoding)
    return split.feed(ids) + split.finish()


def split_one_by_one(encoding: Any, ids: list[int]) -> tuple[ChannelDelta, list[ChannelDelta]]:
    split = ChannelSplit(encoding)
    deltas = [split.feed([token]) for token in ids] + [split.finish()]
    return sum(deltas, ChannelDelta()), deltas


REASONED = (
    "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! 日本語 ✓<|return|>"
)
CALLED = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris", "days": 2}<|call|>'
)


@pytest.mark.parametrize(
    ("text", "content", "reasoning", "calls"),
    [
        (REASONED, "Hello! 日本語 ✓", "The user greets; answer briefly.", []),
        (CALLED, "Checking.", "Need the weather.",
         [ParsedCall("get_weather", {"city": "Paris", "days": 2})]),
        # The recipient may stand in the role's header too (as harmony renders a past call).
        ("<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>"
         'commentary <|constrain|>json<|message|>{"a": 1}<|call|>', "", "x",
         [ParsedCall("f", {"a": 1})]),
        # Arguments that are not a JSON object are no call: their text is the answer's.
        ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]<|call|>',
         "[1, 2]", "", []),
        # Cut short: a call's partial arguments go to the answer; a header after a message
        # holds no text.
        ('<|channel|>commentary to=functions.f<|message|>{"a": ', '{"a": ', "", []),
        ("<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|channel|>fin", "", "Hmm", []),
        # Never in the format, or leaving it: plain text (special tokens skipped).
        ("Hello there, no channels.", "Hello there, no channels.", "", []),
        ("<|channel|>final<|message|>Hi<|end|> and then plain <|end|>text",
         "Hi and then plain text", "", []),
    ],
    ids=["reasoned", "called", "recipient-in-role", "arguments-not-an-object", "call-cut",
         "header-cut", "plain", "leaves-the-format"],
)  # fmt: skip
def test_outputs_split_into_answer_reasoning_and_calls(
    encoding: Any, text: str, content: str, reasoning: str, calls: list[ParsedCall]
) -> None:
    ids = tokens(encoding, text)
    whole = split_whole(encoding, ids)
    assert (whole.content, whole.reasoning, whole.calls) == (content, reasoning, calls)
    one_by_one, _ = split_one_by_one(encoding, ids)
    assert one_by_one == whole


def test_deltas_come_as_their_tokens_do(encoding: Any) -> None:
    ids = tokens(encoding, REASONED)
    _, deltas = split_one_by_one(encoding, ids)
    message = ids.index(200008)  # the first <|message|>: the reasoning starts after it
    assert all(d == ChannelDelta() for d in deltas[: message + 1])
    assert deltas[message + 1].reasoning == encoding.decode([ids[message + 1]])
    assert deltas[-1] == ChannelDelta()  # nothing held back for the end


def test_a_character_split_over_tokens_waits_for_its_last_byte(encoding: Any) -> None:
    """Past the format (plain text), "é" as its two byte tokens: nothing after the first."""
    vocab = {
        base64.b64decode(line.split()[0]): int(line.split()[1])
        for line in (o200k_vocab_dir() / "o200k_base.tiktoken").read_bytes().splitlines()
        if len(base64.b64decode(line.split()[0])) == 1
    }
    split = ChannelSplit(encoding)
    assert split.feed(tokens(encoding, "Hi <|end|>")).content == ""  # a header, so far
    first = split.feed([vocab[b"\xc3"]])
    assert first.content == ""
    assert split.feed([vocab[b"\xa9"]]).content == ""
    assert split.finish().content == "Hi é"
    split = ChannelSplit(encoding)
    split.feed(tokens(encoding, "<|channel|>final<|message|>a<|end|>b"))  # past the format
    assert split.feed([vocab[b"\xc3"]]).content == ""
    assert split.feed([vocab[b"\xa9"]]).content == "é"
    assert split.finish() == ChannelDelta()


def live_frames(encoding: Any, ids: list[int], cuts: list[int]) -> list[Any]:
    """The client frames of a streamed chat request whose output ``ids`` come in updates
    cut at ``cuts``, the last one final."""
    req = LiveRequest(1, "r", b"client", stream=True, want_logprobs=False)
    req.split = ChannelSplit(encoding)
    bounds = [0, *cuts, len(ids)]
    frames: list[Any] = []
    for start, end in itertools.pairwise(bounds):
        final = end == len(ids)
        finish = FinishInfo("stop", ids[-1], Usage(3, len(ids))) if final else None
        frames += req.replies(RequestUpdate(1, ids[start:end], "ignored", finish=finish))
    return frames


@pytest.mark.parametrize("cuts", [[1, 4, 9], [len(REASONED) // 3]], ids=["small", "large"])
def test_the_front_door_sends_each_channel_apart(encoding: Any, cuts: list[int]) -> None:
    ids = tokens(encoding, REASONED.replace("<|return|>", "<|end|><|start|>assistant") + CALLED)
    *chunks, finished = live_frames(encoding, ids, cuts)
    assert all(isinstance(chunk, Chunk) for chunk in chunks) and isinstance(finished, Finished)
    assert finished.text == "".join(c.text for c in chunks) == "Hello! 日本語 ✓Checking."
    assert finished.reasoning == "".join(c.reasoning for c in chunks)
    assert finished.reasoning == "The user greets; answer briefly.Need the weather."
    (call,) = finished.tool_calls
    assert [c for chunk in chunks for c in chunk.tool_calls] == [call]  # sent once, whole
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert finished.output_ids == ids


def test_the_openai_shapes_carry_reasoning_and_calls() -> None:
    shape = Shape(True, "chatcmpl-1", "m", 0, 0, TokenTexts(None))
    call = ToolCall("call_1", "f", '{"a": 1}')
    usage = Usage(3, 4)
    answered = GenerateResult("r", [1], "Hi", "stop", None, usage, None, reasoning="Think")
    called = GenerateResult("r", [1], "", "stop", None, usage, None, tool_calls=[call])
    plain = GenerateResult("r", [1], "Hi", "length", None, usage, None)
    messages = [c["message"] | {"why": c["finish_reason"]} for c in
                shape.full([answered, called, plain])["choices"]]  # fmt: skip
    assert messages == [
        {"role": "assistant", "content": "Hi", "reasoning_content": "Think", "why": "stop"},
        {"role": "assistant", "content": None, "why": "tool_calls",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "assistant", "content": "Hi", "why": "length"},
    ]  # fmt: skip
    deltas = [
        shape.token_chunk(TokenChunk("r", [1], *parts), first_call=2)["choices"][0]["delta"]
        for parts in [("", None, "Think"), ("", None, "", [call]), ("Hi", None), ("", None)]
    ]
    assert deltas == [
        {"reasoning_content": "Think"},
        {"tool_calls": [{"index": 2, "id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"content": "Hi"},
        {"content": ""},  # a token without text yet, as before
    ]  # fmt: skip


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "developer", "content": "And kind."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "It is 20 C."},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}  # fmt: skip
RENDERED = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\nAnd kind.\n\n# Tools\n\n"
    "## functions\n\nnamespace functions {\n\n// Weather of a city\n"
    "type get_weather = (_: {\ncity: string,\n}) => any;\n\n} // namespace functions<|end|>"
    "<|start|>user<|message|>Weather in Paris?<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
    "<|start|>functions.get_weather to=assistant<|channel|>commentary"
    '<|message|>{"temp": 20}<|end|>'
    "<|start|>assistant<|channel|>final<|message|>It is 20 C.<|end|>"
    "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
)


def test_chats_render_in_the_harmony_format(encoding: Any, gpt_oss_tokenizer: Tokenizer) -> None:
    """System and developer turns become the developer's instructions, in order; a call and
    its result find each other by id; the effort goes to the system message."""
    ids = render_chat(encoding, CHAT, [WEATHER], "high")
    assert encoding.decode_utf8(ids) == RENDERED
    plain = render_chat(encoding, CHAT[1:2], [], None)
    assert "Reasoning: medium" in encoding.decode_utf8(plain)
    assert "developer" not in encoding.decode_utf8(plain)
    gpt_oss_tokenizer.harmony = encoding  # as the front door sets it
    try:
        assert gpt_oss_tokenizer.has_chat_template
        assert gpt_oss_tokenizer.apply_chat_template(CHAT, [WEATHER], "high") == ids
        with pytest.raises(ChatTemplateError, match=r"messages\[1\]: role 'function'"):
            gpt_oss_tokenizer.apply_chat_template([CHAT[1], {"role": "function", "content": ""}])
    finally:
        gpt_oss_tokenizer.harmony = None
    orphan = [CHAT[1], {"role": "tool", "tool_call_id": "call_9", "content": "20"}]
    with pytest.raises(HarmonyRefused, match=r"messages\[1\]: its tool_call_id names no call"):
        render_chat(encoding, orphan, [], None)


def test_what_a_harmony_chat_cannot_take_is_refused(gpt_oss_tokenizer: Tokenizer) -> None:
    harmony = Validator(
        msgspec.structs.replace(
            model_facts(None, VOCAB_SIZE), configuration={"output_format": "harmony"}
        ),
        gpt_oss_tokenizer, None,
    )  # fmt: skip
    text = Validator(model_facts(None, VOCAB_SIZE), gpt_oss_tokenizer, None)
    chat = [ChatMessage("user", "Hi")]
    tool = Tool("get_weather", "", '{"type": "object"}')
    harmony.check(Generate("a", messages=chat, reasoning_effort="low", tools=[tool]))
    # A harmony chat's grammar holds its final message, its calls the format's (channels.py).
    harmony.check(Generate("g", messages=chat, grammar=Grammar("regex", "[a-z]+")))
    required = Generate("d", messages=chat, tools=[tool], tool_choice="required")
    assert harmony.check(required).tools == ToolUse(HARMONY, [tool], "required", None, False)
    refusals = [
        (text, Generate("b", messages=chat, reasoning_effort="low"), "reasoning_effort"),
        (harmony, Generate("c", prompt="Hi", reasoning_effort="low"), "reasoning_effort"),
        (harmony, Generate("e", messages=chat, stop=["x"]), "stop strings"),
    ]  # fmt: skip
    for validator, msg, named in refusals:
        with pytest.raises(Rejected) as refused:
            validator.check(msg)
        assert refused.value.code == "unsupported" and named in refused.value.message
    assert request_revision(Generate("f", messages=chat, reasoning_effort="high")) == 5
