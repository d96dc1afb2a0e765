"""A request inside the daemon: explicit counters, no phase enum.

KV index ranges of one admitted request (logical positions; ``pages[i]`` holds positions
``i * page_size .. (i + 1) * page_size - 1``)::

    0 ..... num_cached_pages * page_size ..... scheduled_len ..... allocated_len
    | prefix-cache pages    | written by launched   | reserved; a decode   |
    | (shared, read only)   | steps (private pages) | step's scratch too   |

- ``scheduled_len``: positions whose KV launched steps write (the host plans ahead of the
  device: a step may still be running). For a decoding row under speculative decoding an
  upper bound (planner.py).
- ``allocated_len``: positions covered by ``pages`` (``len(pages) * page_size``); only
  ``PageManager`` (pages.py) changes the two, and ``check_integrity`` asserts they agree.
- ``cached_len``: the prefix-cache hit of the first admission (reported in usage); a
  re-admission may hit more or less.
- ``output_ids``: tokens the host has processed; under overlap the device knows one step
  more (the relay buffer holds the next input token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from outrider.daemon.grammar.state import GrammarState
from outrider.daemon.internal import TokenizedRequest
from outrider.daemon.scheduler.radix import Node
from outrider.plugins.sampling_spec import SamplingSpec
from outrider.protocol.messages import TokenLogprob


@dataclass(frozen=True)
class StepFloor:
    """A launched step's lowest possible start and end (positions) for its request
    (window_pages.py)."""

    start: int
    end: int


@dataclass(frozen=True)
class WindowBackfill:
    """A prefix hit cut short where the prefix cache held no window before its end: the
    cache's nodes of that window (pages ``first .. end - 1``), to be given the window the
    request computes again (window_pages.py)."""

    first: int
    end: int
    nodes: tuple[Node, ...]


@dataclass(eq=False)
class Request:
    rid: int
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    max_new_tokens: int | None
    stop: list[str]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    stream: bool
    want_logprobs: bool
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    num_cached_pages: int = 0  # leading entries of ``pages`` owned by the prefix cache
    allocated_len: int = 0
    cached_len: int = 0
    scheduled_len: int = 0
    # Positions the extend phase of the current admission computes (prompt + processed
    # output at admission); decode batches take the request once scheduled_len reaches it.
    extend_end: int = 0
    # Output tokens that launched steps will produce (>= len(output_ids)); for a decoding
    # row under speculative decoding an upper bound, like scheduled_len.
    scheduled_outputs: int = 0
    # Steps launched and not yet processed that include this request.
    steps_in_flight: int = 0
    # Those of them that may commit more than one token (drafting steps): while any, its
    # scheduled_len and scheduled_outputs are upper bounds, not exact (planner.py).
    open_steps: int = 0
    finished: bool = False
    admitted_once: bool = False
    streamed: int = 0  # output tokens already sent to the detokenizer
    spec_drafts: int = 0  # verify steps applied to this request
    spec_accepted_tokens: int = 0
    # Moving average of the commit lengths of its drafting steps; 0: none yet (drafting.py).
    tau_estimate: float = 0.0
    # Its drafting steps' accepted drafts, a chain cut short's counted at the engine's depth
    # (drafting.py): over ``spec_drafts``, its own mean.
    accepted_at_depth: float = 0.0
    # Whether it feeds a draft that keeps state over the context (drafting.py): decided at its
    # first admission (None before); False for good once it stops.
    fed: bool | None = None
    # Fed to measure its kind's acceptance again, where that said not to feed (drafting.py).
    probe: bool = False
    first_token_time: float = 0.0
    admit_time: float = 0.0
    # Where its output stands in its grammar (daemon/grammar/); None: unconstrained.
    grammar: GrammarState | None = None
    # The most drafts a step commits for it (0: speculation off); None: the engine's.
    max_drafts: int | None = None
    # Window pages (window_pages.py, where the model's sliding layers keep only their
    # windows): those of ``pages[window_from ..]``, and its launched steps' floors.
    window_from: int = 0
    window_pages: list[int] = field(default_factory=list)
    step_floors: deque[StepFloor] = field(default_factory=deque)
    window_backfill: WindowBackfill | None = None

    @classmethod
    def from_message(cls, msg: TokenizedRequest, grammar: GrammarState | None = None) -> Request:
        return cls(
            rid=msg.rid,
            request_id=msg.request_id,
            prompt_ids=list(msg.input_ids),
            sampling=msg.sampling,
            max_new_tokens=msg.max_new_tokens,
            stop=list(msg.stop),
            stop_token_ids=frozenset(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            stream=msg.stream,
            want_logprobs=msg.want_logprobs,
            arrival=msg.arrival,
            grammar=grammar,
            max_drafts=msg.max_drafts,
        )

    def known_ids(self) -> list[int]:
        """Prompt plus processed output: every token the host knows."""
        return self.prompt_ids + self.output_ids

    @property
    def decoding(self) -> bool:
        """Admitted and past its extend phase: its next input token is in the relay buffer."""
        return self.slot >= 0 and self.scheduled_len >= self.extend_end
