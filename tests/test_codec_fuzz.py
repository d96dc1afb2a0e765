"""The frame codec and the client's reply routing against hostile bytes.

Contract: ``FrameCodec.decode`` returns a message or raises ``FrameError`` with a wire error
code, whatever the bytes; a client survives any reply frame, and a reply frame that cannot be
decoded but still names its request ends that request with ``Error('malformed')``. Frames with
invalid UTF-8 and deep nesting are built by hand (msgpack headers around raw bytes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from outrider.protocol import Client
from outrider.protocol.frames import (
    FAMILY_CLIENT_REQUEST,
    FrameCodec,
    FrameError,
    reply_codec,
    request_codec,
)
from outrider.protocol.messages import (
    ERROR_CODES,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    Abort,
    Ack,
    ChatMessage,
    Chunk,
    ClientReply,
    ClientRequest,
    Error,
    Finished,
    Generate,
    Health,
    HealthQuery,
    ServerInfo,
    ServerInfoQuery,
    TokenLogprob,
    Usage,
    request_revision,
)

T = TypeVar("T")

# NOTE: hypothesis keeps its example database and caches in ./.hypothesis: none of it goes
# into the checkout (no database; caches in the temporary directory).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "outrider-hypothesis")
FUZZ = settings(max_examples=250, deadline=None, database=None)

CODEC_ERRORS = frozenset({"malformed", "unsupported_version", "invalid_request"})
RID = "rid-1"  # the request id the hand-built frames carry, and the one the client waits on
MARK = "\u2603marked\u2603"  # stands for the str value a test corrupts
REQUESTS = request_codec()
REPLIES = reply_codec()


def decode(codec: FrameCodec[T], frame: bytes) -> T | FrameError:
    """The message, or the ``FrameError``, that ``frame`` decodes to; anything else raised
    fails the property."""
    try:
        return codec.decode(frame)
    except FrameError as exc:
        assert exc.code in CODEC_ERRORS and exc.code in ERROR_CODES, exc.code
        assert isinstance(exc.request_id, str) and isinstance(exc.message, str)
        return exc


# --- msgpack by hand ---------------------------------------------------------------------


def mp_str(raw: bytes) -> bytes:
    """A msgpack str header around ``raw``, valid UTF-8 or not."""
    n = len(raw)
    if n < 32:
        return bytes([0xA0 | n]) + raw
    if n < 1 << 8:
        return b"\xd9" + n.to_bytes(1, "big") + raw
    if n < 1 << 16:
        return b"\xda" + n.to_bytes(2, "big") + raw
    return b"\xdb" + n.to_bytes(4, "big") + raw


def mp_map(*pairs: tuple[bytes, bytes]) -> bytes:
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(key + value for key, value in pairs)


def nested(depth: int, kind: str) -> bytes:
    """A nil inside ``depth`` one-element arrays or maps."""
    opener = b"\x91" if kind == "array" else b"\x81" + mp_str(b"k")
    return opener * depth + b"\xc0"


def with_version(frame: bytes, version: int) -> bytes:
    return bytes([frame[0] & 0xF0 | version]) + frame[1:]


def corrupt(frame: bytes, target: str, bad: bytes) -> bytes:
    """``frame`` with the msgpack str ``target`` (once in it) replaced by the bytes ``bad``."""
    packed = mp_str(target.encode())
    assert frame.count(packed) == 1, (target, frame)
    return frame.replace(packed, mp_str(bad))


# --- strategies --------------------------------------------------------------------------

request_ids = st.text(min_size=1, max_size=24)
texts = st.text(max_size=40)
token_ids = st.integers(0, MAX_TOKEN_ID)
floats = st.floats(allow_nan=False)

generates = st.builds(
    Generate,
    request_id=request_ids,
    prompt=st.none() | texts,
    input_ids=st.none() | st.lists(token_ids, max_size=8),
    messages=st.none()
    | st.lists(st.builds(ChatMessage, role=st.text(max_size=64), content=texts), max_size=3),
    max_new_tokens=st.none() | token_ids,
    temperature=st.none() | st.floats(0.0, 100.0),
    top_p=st.none() | st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.none() | token_ids,
    seed=st.none() | st.integers(0, MAX_SEED),
    stop=st.lists(texts, max_size=MAX_STOP_STRINGS),
    stop_token_ids=st.lists(token_ids, max_size=8),
    ignore_eos=st.booleans(),
    logprobs=st.integers(0, MAX_LOGPROBS),
    stream=st.booleans(),
    min_p=st.floats(0.0, 1.0),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    repetition_penalty=st.floats(0.0, 10.0, exclude_min=True),
    logit_bias=st.dictionaries(token_ids, st.floats(-100.0, 100.0), max_size=4),
)
requests: st.SearchStrategy[ClientRequest] = st.one_of(
    generates,
    st.builds(Abort, request_id=request_ids, target_id=request_ids),
    st.builds(HealthQuery, request_id=request_ids),
    st.builds(ServerInfoQuery, request_id=request_ids),
)

reply_ids = st.sampled_from([RID, "other", ""])
logprobs = st.none() | st.lists(
    st.builds(
        TokenLogprob,
        token_id=token_ids,
        logprob=floats,
        top=st.lists(st.tuples(token_ids, floats), max_size=3),
    ),
    max_size=3,
)
counts = st.integers(0, 2**40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | floats | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=10,
)
replies: st.SearchStrategy[ClientReply] = st.one_of(
    st.builds(
        Chunk,
        request_id=reply_ids,
        token_ids=st.lists(token_ids, max_size=8),
        text=texts,
        logprobs=logprobs,
    ),
    st.builds(
        Finished,
        request_id=reply_ids,
        output_ids=st.lists(token_ids, max_size=8),
        text=texts,
        finish_reason=st.sampled_from(["stop", "length", "abort"]),
        matched_stop=st.none() | texts | token_ids,
        usage=st.builds(Usage, counts, counts, counts, counts, counts),
        logprobs=logprobs,
    ),
    st.builds(
        Error, request_id=reply_ids, code=st.sampled_from(sorted(ERROR_CODES)), message=texts
    ),
    st.builds(Ack, request_id=reply_ids),
    st.builds(
        Health,
        request_id=reply_ids,
        status=st.sampled_from(["serving", "not_serving", "draining"]),
        boot_id=texts,
        version=texts,
        protocol_version=st.integers(0, 15),
    ),
    st.builds(
        ServerInfo,
        request_id=reply_ids,
        boot_id=texts,
        model=texts,
        configuration=st.dictionaries(texts, json_values, max_size=4),
        plugins=st.dictionaries(texts, texts, max_size=3),
        running=counts,
        waiting=counts,
        kv_used_tokens=counts,
        kv_total_tokens=counts,
        prefix_cache_queries=counts,
        prefix_cache_hits=counts,
        requests_finished=st.dictionaries(texts, counts, max_size=3),
        spec_accepted_per_position=st.lists(counts, max_size=4),
    ),
)


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    """A frame from ``frames`` with a few bytes replaced, inserted or deleted, or cut short."""
    frame = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(frame)))
        edit = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        if edit == "replace" and at < len(frame):
            frame[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "delete":
            del frame[at : at + draw(st.integers(1, 8))]
        elif edit == "truncate":
            del frame[at:]
    return bytes(frame)


INVALID_UTF8 = [
    b"\xff",
    b"\x80",  # a continuation byte with no lead
    b"\xc3\x28",  # a lead byte without its continuation
    b"\xe2\x82",  # cut short
    b"\xc0\xaf",  # overlong
    b"\xed\xa0\x80",  # a surrogate
    b"\xf4\x90\x80\x80",  # past U+10FFFF
]
# Long prefixes reach the str8 and str16 headers.
invalid_utf8 = st.builds(
    lambda head, bad, tail: head.encode() + bad + tail.encode(),
    st.text(max_size=300),
    st.sampled_from(INVALID_UTF8),
    st.text(max_size=20),
)
DEPTHS = [1, 16, 256, 900, 1_000, 2_000, 10_000, 100_000]
BEYOND_ANY_LIMIT = 10_000  # hypothesis lifts the recursion limit by about 2,000 frames

request_frames = requests.map(REQUESTS.encode)
reply_frames = replies.map(REPLIES.encode)


# --- the request codec -------------------------------------------------------------------


@FUZZ
@given(requests)
def test_requests_round_trip(msg: ClientRequest) -> None:
    assert REQUESTS.decode(REQUESTS.encode(msg)) == msg


class GenerateBeforeNone(msgspec.Struct, tag="generate", frozen=True):
    """``Generate`` as clients built it before its sampling fields could be left out."""

    request_id: str
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int = 0
    stream: bool = False


def _protocol_1_0(msg: Generate, t: float, p: float, k: int) -> Generate:
    """``msg`` with the given sampling values, the fields of protocol 1.1 at their defaults."""
    return msgspec.structs.replace(
        msg,
        temperature=t,
        top_p=p,
        top_k=k,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        logit_bias={},
    )


with_sampling_values = st.builds(
    _protocol_1_0,
    generates,
    st.floats(0.0, 100.0),
    st.floats(0.0, 1.0, exclude_min=True),
    token_ids,
)


@FUZZ
@given(with_sampling_values)
def test_requests_with_sampling_values_keep_their_bytes(msg: Generate) -> None:
    """A request of protocol 1.0 as old clients encode it is served as it always was; a new
    client sends it as revision 1, which a daemon of 1.0 takes."""
    old_fields = GenerateBeforeNone.__struct_fields__
    before = GenerateBeforeNone(**{name: getattr(msg, name) for name in old_fields})
    frame = bytes([FAMILY_CLIENT_REQUEST << 4 | 1]) + msgspec.msgpack.encode(before)
    assert REQUESTS.decode(frame) == msg
    assert request_revision(msg) == 1
    assert REQUESTS.encode(msg, 1)[0] == frame[0]
    assert REQUESTS.decode(REQUESTS.encode(msg, 1)) == msg


def test_an_old_clients_default_values_still_arrive() -> None:
    frame = REQUESTS.header + msgspec.msgpack.encode(GenerateBeforeNone("r"))
    assert REQUESTS.decode(frame) == Generate("r", temperature=1.0, top_p=1.0, top_k=0)


@FUZZ
@given(st.binary(max_size=300) | st.binary(max_size=300).map(REQUESTS.header.__add__))
def test_any_bytes_decode_or_raise_frame_error(frame: bytes) -> None:
    assert isinstance(decode(REQUESTS, frame), ClientRequest | FrameError)
    assert isinstance(decode(REPLIES, frame), ClientReply | FrameError)


@FUZZ
@given(mutated(request_frames))
def test_mutated_requests_decode_or_raise_frame_error(frame: bytes) -> None:
    assert isinstance(decode(REQUESTS, frame), ClientRequest | FrameError)


# Every str value of every request type: (message with MARK in it, the str to corrupt).
REQUEST_STRINGS: list[tuple[ClientRequest, str]] = [
    (Generate(RID, prompt=MARK), "generate"),
    (Generate(MARK, prompt="p"), MARK),
    (Generate(RID, prompt=MARK), MARK),
    (Generate(RID, messages=[ChatMessage(MARK, "c")]), MARK),
    (Generate(RID, messages=[ChatMessage("user", MARK)]), MARK),
    (Generate(RID, input_ids=[1], stop=["a", MARK]), MARK),
    (Abort(RID, target_id="t"), "abort"),
    (Abort(MARK, target_id="t"), MARK),
    (Abort(RID, target_id=MARK), MARK),
    (HealthQuery(RID), "health"),
    (HealthQuery(MARK), MARK),
    (ServerInfoQuery(RID), "server_info"),
    (ServerInfoQuery(MARK), MARK),
]


@FUZZ
@given(st.sampled_from(REQUEST_STRINGS), invalid_utf8)
def test_invalid_utf8_in_any_request_string_is_malformed(
    case: tuple[ClientRequest, str], bad: bytes
) -> None:
    msg, target = case
    outcome = decode(REQUESTS, corrupt(REQUESTS.encode(msg), target, bad))
    assert isinstance(outcome, FrameError) and outcome.code == "malformed"
    # msgspec's own words name the encoding ("'utf-8' codec can't decode" up to 0.22,
    # "Invalid UTF-8 encoded string" from 0.23).
    assert outcome.message.startswith("undecodable body: ")
    assert "utf-8" in outcome.message.lower()
    assert outcome.request_id == ("" if msg.request_id == MARK else RID)


@FUZZ
@given(st.sampled_from(["type", "request_id", "prompt", "stream"]), invalid_utf8)
def test_invalid_utf8_in_a_request_key(key: str, bad: bytes) -> None:
    frame = corrupt(REQUESTS.encode(Generate(RID, prompt="p")), key, bad)
    assert isinstance(decode(REQUESTS, frame), ClientRequest | FrameError)


def request_nests(depth: int, kind: str) -> list[bytes]:
    """Request frames with ``nested(depth, kind)`` in an unknown field, in known fields, as the
    whole body, and each of those behind a wrong version byte."""
    deep = nested(depth, kind)
    health = [(mp_str(b"type"), mp_str(b"health")), (mp_str(b"request_id"), mp_str(RID.encode()))]
    generate = [(mp_str(b"type"), mp_str(b"generate")), (mp_str(b"request_id"), mp_str(b"r"))]
    bodies = [
        mp_map(*health, (mp_str(b"later"), deep)),
        mp_map((mp_str(b"earlier"), deep), *health),
        *(
            mp_map(*generate, (mp_str(field), deep))
            for field in (b"input_ids", b"messages", b"stop")
        ),
        deep,
    ]
    frames = [REQUESTS.header + body for body in bodies]
    return frames + [with_version(frame, REQUESTS.version + 1) for frame in frames]


@pytest.mark.parametrize("kind", ["array", "map"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_nesting_in_requests_decodes_or_raises_frame_error(depth: int, kind: str) -> None:
    for frame in request_nests(depth, kind):
        outcome = decode(REQUESTS, frame)
        assert isinstance(outcome, ClientRequest | FrameError)
        if depth >= BEYOND_ANY_LIMIT:
            assert isinstance(outcome, FrameError)


# --- the reply codec ---------------------------------------------------------------------


@FUZZ
@given(replies)
def test_replies_round_trip(msg: ClientReply) -> None:
    assert REPLIES.decode(REPLIES.encode(msg)) == msg


@FUZZ
@given(mutated(reply_frames))
def test_mutated_replies_decode_or_raise_frame_error(frame: bytes) -> None:
    assert isinstance(decode(REPLIES, frame), ClientReply | FrameError)


def info(**changes: Any) -> ServerInfo:
    fields: dict[str, Any] = {
        "request_id": RID, "boot_id": "b", "model": "m", "configuration": {"c": ["v"]},
        "plugins": {"p": "q"}, "running": 0, "waiting": 0, "kv_used_tokens": 0,
        "kv_total_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
        "requests_finished": {"stop": 1},
    }  # fmt: skip
    return ServerInfo(**(fields | changes))


# Every str value of every reply type, Literal fields and dict keys included.
REPLY_STRINGS: list[tuple[ClientReply, str]] = [
    (Chunk(MARK, [1], "t"), MARK),
    (Chunk(RID, [1], MARK), MARK),
    (Finished(RID, [1], MARK, "stop"), MARK),
    (Finished(RID, [1], "t", "length"), "length"),
    (Finished(RID, [1], "t", "stop", MARK), MARK),
    (Error(RID, "overloaded", MARK), MARK),
    (Error(RID, "overloaded", "m"), "overloaded"),
    (Error(MARK, "overloaded", "m"), MARK),
    (Ack(MARK), MARK),
    (Health(RID, "draining", "b", "v", 1), "draining"),
    (Health(RID, "serving", MARK, "v", 1), MARK),
    (Health(RID, "serving", "b", MARK, 1), MARK),
    (Health(MARK, "serving", "b", "v", 1), MARK),
    (info(request_id=MARK), MARK),
    (info(boot_id=MARK), MARK),
    (info(model=MARK), MARK),
    (info(configuration={MARK: 1}), MARK),
    (info(configuration={"c": [{MARK: 1}]}), MARK),
    (info(configuration={"c": MARK}), MARK),
    (info(plugins={MARK: "q"}), MARK),
    (info(plugins={"p": MARK}), MARK),
    (info(requests_finished={MARK: 1}), MARK),
]


@FUZZ
@given(st.sampled_from(REPLY_STRINGS), invalid_utf8)
def test_invalid_utf8_in_any_reply_string_is_malformed(
    case: tuple[ClientReply, str], bad: bytes
) -> None:
    msg, target = case
    outcome = decode(REPLIES, corrupt(REPLIES.encode(msg), target, bad))
    assert isinstance(outcome, FrameError) and outcome.code == "malformed"
    assert outcome.request_id == ("" if msg.request_id == MARK else RID)


def reply_nests(depth: int, kind: str) -> list[bytes]:
    """Reply frames (``[tag, request_id, ...]``) with ``nested(depth, kind)`` in known fields,
    after the last field, as the whole body, and each of those behind a wrong version byte."""
    deep = nested(depth, kind)
    packed_id = mp_str(RID.encode())
    configuration = mp_map((mp_str(b"c"), b"\x91" + mp_str(b"v")))
    frames = [
        REPLIES.header + b"\x94\x01" + packed_id + deep + mp_str(b"t"),  # Chunk.token_ids
        REPLIES.header + b"\x93\x04" + packed_id + deep,  # Ack, one element too many
        REPLIES.encode(info()).replace(configuration, mp_map((mp_str(b"c"), deep))),
        REPLIES.header + deep,
    ]
    return frames + [with_version(frame, REPLIES.version + 1) for frame in frames]


@pytest.mark.parametrize("kind", ["array", "map"])
@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_nesting_in_replies_decodes_or_raises_frame_error(depth: int, kind: str) -> None:
    for frame in reply_nests(depth, kind):
        outcome = decode(REPLIES, frame)
        assert isinstance(outcome, ClientReply | FrameError)
        if depth >= BEYOND_ANY_LIMIT:
            assert isinstance(outcome, FrameError)


# --- the client --------------------------------------------------------------------------


hostile_replies = st.one_of(
    reply_frames,
    mutated(reply_frames),
    st.tuples(st.sampled_from(REPLY_STRINGS), invalid_utf8).map(
        lambda case: corrupt(REPLIES.encode(case[0][0]), case[0][1], case[1])
    ),
    st.tuples(st.sampled_from([16, 1_000, 10_000]), st.sampled_from(["array", "map"])).flatmap(
        lambda args: st.sampled_from(reply_nests(*args))
    ),
    st.binary(max_size=64).map(REPLIES.header.__add__),
)


def error_codes(replies: list[ClientReply]) -> list[str]:
    assert all(isinstance(r, Error) and r.request_id == RID for r in replies), replies
    return [r.code for r in replies if isinstance(r, Error)]


def test_a_client_survives_any_reply(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``_dispatch`` raises nothing; a frame that names the waiting request ends it with what
    it decodes to, or with ``Error('malformed')`` when it does not decode."""
    with Client(f"ipc://{tmp_path_factory.mktemp('ipc')}/nobody.sock") as client:

        @FUZZ
        @given(hostile_replies)
        def routes(frame: bytes) -> None:
            client.boot_id = None  # no restart detection across examples
            inbox = client._register(RID)
            try:
                client._dispatch(frame)
                outcome = decode(REPLIES, frame)
                got = list(inbox.replies)
                if not isinstance(outcome, FrameError):
                    assert got == ([outcome] if outcome.request_id == RID else [])
                elif outcome.code == "unsupported_version":
                    assert error_codes(got) == ["unsupported_version"]
                elif outcome.request_id == RID:
                    assert error_codes(got) == ["malformed"]
                else:
                    assert got == []
            finally:
                client._release(inbox, abort=False)

        routes()


# --- the reported frames -----------------------------------------------------------------


def test_the_reported_invalid_utf8_frame_is_malformed() -> None:
    frame = b"\x11\x82\xa4type\xa6health\xaarequest_id\xa1\xff"
    with pytest.raises(FrameError) as err:
        REQUESTS.decode(frame)
    assert (err.value.code, err.value.request_id) == ("malformed", "")
    assert err.value.message.startswith("undecodable body: ")
    # The id is still read for the error reply when only another field is broken.
    prompt = mp_map(
        (mp_str(b"type"), mp_str(b"generate")),
        (mp_str(b"request_id"), mp_str(b"r")),
        (mp_str(b"prompt"), mp_str(b"\xff")),
    )
    with pytest.raises(FrameError) as err:
        REQUESTS.decode(REQUESTS.header + prompt)
    assert (err.value.code, err.value.request_id) == ("malformed", "r")
    # Behind another version byte, the body is read only for its request id.
    with pytest.raises(FrameError) as err:
        REQUESTS.decode(with_version(frame, REQUESTS.version + 1))
    assert (err.value.code, err.value.request_id) == ("unsupported_version", "")


@pytest.mark.parametrize("depth", [BEYOND_ANY_LIMIT, 100_000])
def test_deep_nesting_is_malformed(depth: int) -> None:
    health = [(mp_str(b"type"), mp_str(b"health")), (mp_str(b"request_id"), mp_str(b"r"))]
    unknown_field = REQUESTS.header + mp_map(*health, (mp_str(b"x"), nested(depth, "array")))
    assert len(unknown_field) < 200 + depth
    with pytest.raises(FrameError) as err:
        REQUESTS.decode(unknown_field)
    assert (err.value.code, err.value.request_id) == ("malformed", "")
    assert err.value.message.startswith("undecodable body: ")
    with pytest.raises(FrameError) as err:
        REQUESTS.decode(with_version(unknown_field, REQUESTS.version + 1))
    assert (err.value.code, err.value.request_id) == ("unsupported_version", "")
    with pytest.raises(FrameError) as err:
        REPLIES.decode(REPLIES.header + b"\x93\x04" + mp_str(b"r") + nested(depth, "map"))
    assert err.value.code == "malformed"
