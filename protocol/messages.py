"""Client-facing wire messages.

Every frame is ``[kind/version byte][msgpack body]``; see ``frames.py``. Requests (client ->
daemon) are plain tagged structs; replies (daemon -> client) are ``array_like`` tagged structs
(a msgspec union may not mix the two). Fields are only ever appended, with defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

PROTOCOL_VERSION = 1
# The version nibbles of request frames: 1 is protocol 1.0; 2 is protocol 1.1, which adds
# Generate's min_p, penalties and logit_bias; 3 is protocol 1.2, which adds its grammar and
# tools (and the chat messages' tool calls); 4 is protocol 1.3, which adds its max_drafts; 5 is
# protocol 1.4, which adds its reasoning_effort.
# A client sends the oldest revision that carries
# its request (``request_revision``): an older daemon serves every request it can honour and
# refuses the rest (unsupported_version) instead of ignoring fields it does not know.
# Replies keep revision 1: a field is only ever added at a reply's end, which a client that
# does not know it ignores (Chunk's and Finished's ``reasoning`` and ``tool_calls``).
REQUEST_REVISIONS = (1, 2, 3, 4, 5)
PROTOCOL_MINOR = len(REQUEST_REVISIONS) - 1

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1
# A temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]: decoding enforces the
# closed range, and the daemon refuses the gap above 0 (invalid_request).
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
# Logit adjustments (OpenAI's ranges; repetition as Hugging Face's, 1 = off).
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_PENALTY = 2.0  # presence and frequency
MAX_REPETITION_PENALTY = 10.0
MAX_DRAFTS = 1024  # a request's draft cap; any cap past the engine's depth is none
# The largest client frame a daemon takes by default (``--max-message-bytes``): a larger one
# ends the sender's connection, so the client library refuses to send one.
DEFAULT_MAX_MESSAGE_BYTES = 8 * 2**20
# A daemon sends every client with calls in flight some frame (a reply, or the probe
# ``Ack("")``) at least this often; a client that hears nothing for several times as long
# has lost the daemon (the client library's ``idle_timeout``).
PROBE_MAX_S = 8.0

FinishReason = Literal["stop", "length", "abort"]

ErrorCode = Literal[
    "invalid_request",
    "prompt_too_long",
    "unsupported",
    "unknown_request",
    "duplicate_request_id",
    "overloaded",
    "shutting_down",
    "unsupported_version",
    "malformed",
    "connection_lost",
    "slow_consumer",
    "internal",
]
ERROR_CODES: frozenset[str] = frozenset(ErrorCode.__args__)  # type: ignore[attr-defined]  # Literal

RequestId = Annotated[str, Meta(min_length=1, max_length=256)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
# The sampling values as they decode, from the wire or a model's generation_config.json.
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]  # 0: greedy
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]  # 0: no top-k
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]  # 0: no cut
Penalty = Annotated[float, Meta(ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)]  # 0: off
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]  # 1: off
MaxDrafts = Annotated[int, Meta(ge=0, le=MAX_DRAFTS)]  # 0: speculation off
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Meta(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]],
    Meta(max_length=MAX_LOGIT_BIAS),
]


# --- requests (client -> daemon) ---------------------------------------------------------


MAX_GRAMMAR_CHARS = 65536
MAX_TOOLS = 128
ToolName = Annotated[str, Meta(min_length=1, max_length=256)]
ReasoningEffort = Literal["low", "medium", "high"]


class ToolCall(Struct, frozen=True, gc=False):
    """A call an assistant message made (protocol 1.2): ``arguments`` as JSON text."""

    id: Annotated[str, Meta(max_length=256)]
    name: ToolName
    arguments: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)]


class ChatMessage(Struct, frozen=True, gc=False):
    """One message of a chat. An assistant's may carry its ``tool_calls``; a ``tool``
    message answers the call ``tool_call_id`` (protocol 1.2)."""

    role: Annotated[str, Meta(max_length=64)]
    content: str
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOLS)] = []
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


class Tool(Struct, frozen=True, gc=False):
    """A function the model may call (protocol 1.2): ``parameters`` is the JSON Schema of its
    arguments, as JSON text ("" for any object)."""

    name: ToolName
    description: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""
    parameters: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""


# ``auto``: the model may answer or call; ``none``: it answers (the tools are still shown to
# it); ``required``: it calls at least one (``Generate.tool_name``: that one).
ToolChoice = Literal["auto", "none", "required"]


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "lark"]
MAX_CHOICES = 1024


class Grammar(Struct, frozen=True, gc=False):
    """What a constrained output must match (protocol 1.2), by ``kind``:

    - ``json_schema``: a JSON document valid under the JSON Schema ``text``;
    - ``json_object``: any JSON object (``text`` empty);
    - ``regex``: a whole match of the regular expression ``text``;
    - ``choice``: exactly one of ``choices``;
    - ``ebnf``: a sentence of the grammar ``text`` (GBNF: rules ``name ::= ...``, from
      ``root``);
    - ``lark``: a sentence of the Lark grammar ``text`` (rules ``name: ...``, from
      ``start``).

    The output ends where the grammar lets it end and the model chooses its end of sequence;
    a request cut short by ``max_new_tokens`` ends ``length`` with the partial output. A chat
    to a model whose output is in the harmony format (``ServerInfo.configuration
    ["output_format"]`` "harmony") is held in its final answer (``text``), its reasoning free.
    """

    kind: GrammarKind
    text: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""
    choices: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]],
        Meta(max_length=MAX_CHOICES),
    ] = []


class Generate(Struct, tag="generate", frozen=True):
    """One generation request. Exactly one of ``prompt``, ``input_ids``, ``messages``.

    ``temperature``, ``top_p`` and ``top_k`` left out (None, or absent from the map) take the
    daemon's sampling defaults: the model's generation_config.json values, or 1.0, 1.0 and 0
    (``outrider serve --generation-config``). Their defaults were those three values before
    None was allowed: a request that sends values decodes as it always did.

    ``min_p``, the penalties and ``logit_bias`` (protocol 1.1; their defaults change nothing)
    adjust the target's logits before the sampling rule: ``logit_bias`` adds to a token's
    logit, ``repetition_penalty`` divides a positive logit (multiplies a negative one) of a
    token of the prompt or the output, ``frequency_penalty`` and ``presence_penalty`` subtract
    from a token of the output its count and its presence; ``min_p`` drops tokens less likely
    than ``min_p`` times the most likely one.

    ``grammar`` (protocol 1.2) constrains the output: at each position only tokens that keep
    it a prefix of a match are drawn (``Grammar``).

    ``tools`` (protocol 1.2, chat requests only) are shown to the model through its chat
    template, and its calls are held to their schemas in the model's own tool-call format
    (``ServerInfo.configuration["tool_call_format"]``): ``tool_choice`` ``auto`` lets it
    answer or call, ``none`` lets it answer only, ``required`` makes it call at least one tool
    (with ``tool_name``: that one); ``parallel_tool_calls`` False allows one call. The output
    text holds the calls as the model writes them.

    ``reasoning_effort`` (protocol 1.4, chat requests to a model in the harmony format:
    ``ServerInfo.configuration["output_format"]``) sets how long the model reasons; None: the
    format's default (medium). Other models refuse it.

    ``max_drafts`` (protocol 1.3) caps the drafted tokens a speculative step may accept for
    this request (0 turns speculation off for it; None: the daemon's); the output is the same
    either way (greedy and seeded), only how many tokens a step commits changes.
    """

    request_id: RequestId
    prompt: str | None = None
    input_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    max_new_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=1024)] = []
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] = 0
    stream: bool = False
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = {}
    grammar: Grammar | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] = []
    tool_choice: ToolChoice = "auto"
    tool_name: ToolName | None = None
    parallel_tool_calls: bool = True
    max_drafts: MaxDrafts | None = None
    reasoning_effort: ReasoningEffort | None = None


class Abort(Struct, tag="abort", frozen=True):
    """Abort the live request ``target_id``; answered with ``Ack`` or an ``Error``."""

    request_id: RequestId
    target_id: RequestId


class HealthQuery(Struct, tag="health", frozen=True):
    request_id: RequestId


class ServerInfoQuery(Struct, tag="server_info", frozen=True):
    request_id: RequestId


ClientRequest = Generate | Abort | HealthQuery | ServerInfoQuery


# --- replies (daemon -> client) ----------------------------------------------------------


class TokenLogprob(Struct, array_like=True, frozen=True, gc=False):
    """Log-probability of one output token under the target, plus the ``top`` alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Usage(Struct, array_like=True, frozen=True, gc=False):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_drafts: int = 0
    spec_accepted_tokens: int = 0


class Chunk(Struct, array_like=True, tag=1, frozen=True):
    """Tokens committed since the last chunk of a streamed request.

    For a chat request to a model whose output has channels
    (``ServerInfo.configuration["output_format"]`` "harmony": gpt-oss), ``text`` is the
    answer's, ``reasoning`` the reasoning's and ``tool_calls`` the calls the tokens
    completed, each call once whole; for every other request ``text`` is the tokens' text and
    the two stay empty."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class Finished(Struct, array_like=True, tag=2, frozen=True):
    """The final frame of a request that ran (``stop``, ``length`` or ``abort``); its
    ``text``, ``reasoning`` and ``tool_calls`` are the whole output's (``Chunk``)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    matched_stop: str | int | None = None
    usage: Usage = Usage()
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = []


class Error(Struct, array_like=True, tag=3, frozen=True):
    """A typed error; final for ``request_id``."""

    request_id: str
    code: ErrorCode
    message: str


class Ack(Struct, array_like=True, tag=4, frozen=True):
    """An abort was done. ``Ack("")`` is the daemon's probe of a client with requests in
    flight (a send to a vanished client fails); no request has an empty id: ignore it."""

    request_id: str


class Health(Struct, array_like=True, tag=5, frozen=True):
    request_id: str
    status: Literal["serving", "not_serving", "draining"]
    boot_id: str
    version: str
    protocol_version: int


class LatencyHistogram(Struct, array_like=True, frozen=True, gc=False):
    """Latencies in seconds, in fixed buckets: ``counts[i]`` of them fell in
    ``(bounds[i - 1], bounds[i]]``, and ``counts[-1]`` above the last bound (not cumulative;
    ``len(counts) == len(bounds) + 1``). ``sum`` is the total of all of them."""

    bounds: list[float] = []
    counts: list[int] = []
    sum: float = 0.0


class ServerInfo(Struct, array_like=True, tag=6, frozen=True):
    """Daemon state; counters are monotone over the daemon's life (``boot_id``).

    The token totals and latencies are the front door's (the process that owns the client
    socket): ``prompt_tokens`` counts the prompts of requests that ended with ``Finished``,
    ``generation_tokens`` every output token as it reaches the front door. Latencies run from
    a ``Generate``'s arrival: ``time_to_first_token`` for every finished request (to the first
    ``Chunk``, or for a request not streamed to its first committed token), ``inter_token_latency``
    (between two ``Chunk``s) for streamed requests only, ``e2e_request_latency`` to every
    ``Finished``.
    """

    request_id: str
    boot_id: str
    model: str
    configuration: dict[str, Any]
    plugins: dict[str, str]
    running: int
    waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: dict[str, int]
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: LatencyHistogram = LatencyHistogram()
    inter_token_latency: LatencyHistogram = LatencyHistogram()
    e2e_request_latency: LatencyHistogram = LatencyHistogram()


ClientReply = Chunk | Finished | Error | Ack | Health | ServerInfo


def request_revision(msg: ClientRequest) -> int:
    """The oldest request revision (``REQUEST_REVISIONS``) whose fields carry ``msg``."""
    if isinstance(msg, Generate) and msg.reasoning_effort is not None:
        return 5
    if isinstance(msg, Generate) and msg.max_drafts is not None:
        return 4
    if isinstance(msg, Generate) and (
        msg.grammar is not None
        or msg.tools
        or any(m.tool_calls or m.tool_call_id is not None for m in msg.messages or [])
    ):
        return 3
    if isinstance(msg, Generate) and (
        msg.min_p
        or msg.presence_penalty
        or msg.frequency_penalty
        or msg.repetition_penalty != 1.0
        or msg.logit_bias
    ):
        return 2
    return 1


def is_final(reply: ClientReply) -> bool:
    """Whether ``reply`` ends its request (every request gets exactly one final reply)."""
    return not isinstance(reply, Chunk)
