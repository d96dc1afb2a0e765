"""``outrider generate``: send one prompt to a running daemon and print the answer; exit 0
only for a complete answer (an aborted one is printed, then said on stderr, exit 1).

A client command: it imports ``outrider.protocol`` and the standard library only, so it works
in a light install (no torch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Final

import msgspec

from outrider.protocol import (
    Client,
    GenerateResult,
    Grammar,
    NotListening,
    RequestError,
    Timeout,
    TokenStream,
    default_endpoint,
)
from outrider.protocol.endpoints import ipc_path, not_listening_reason

DEFAULT_TIMEOUT_S: Final = 300.0
# NOTE: the daemon's front door answers health itself, never queued behind generation.
HEALTH_DEADLINE_S: Final = 5.0


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt", nargs="?", metavar="PROMPT", help="the prompt; '-' or nothing reads stdin"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as one user message, through the model's chat template with a "
        "generation prompt (default: off, the prompt as raw text)",
    )
    parser.add_argument(
        "--connect", metavar="ENDPOINT", help=f"daemon endpoint (default: {default_endpoint()})"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="most tokens to generate (default: until a stop condition or the context limit)",
    )
    model_default = "default: the model's, see serve --generation-config"
    parser.add_argument(
        "--temperature", type=float, metavar="T", help=f"0: greedy ({model_default})"
    )
    parser.add_argument("--top-p", type=float, metavar="P", help=f"nucleus mass ({model_default})")
    parser.add_argument("--top-k", type=int, metavar="K", help=f"0: no top-k ({model_default})")
    parser.add_argument(
        "--seed", type=int, metavar="S", help="sampling seed (default: one the daemon picks)"
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the most likely one (default: 0, none)",
    )
    for name, neutral, what in (
        ("presence", 0.0, "subtracted from the logit of each token the output holds"),
        ("frequency", 0.0, "times its count, subtracted from each output token's logit"),
        ("repetition", 1.0, "divides a positive logit of a prompt or output token"),
    ):
        parser.add_argument(
            f"--{name}-penalty", type=float, default=neutral, metavar="X",
            help=f"{what} (default: {neutral:g}, off)",
        )  # fmt: skip
    parser.add_argument(
        "--logit-bias",
        type=_logit_bias,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit (repeatable; default: none)",
    )
    parser.add_argument(
        "--max-drafts",
        type=int,
        metavar="N",
        help="the drafted tokens a speculative step may accept for it (0: speculation off; "
        "default: the daemon's)",
    )
    parser.add_argument(
        "--reasoning-effort",
        choices=("low", "medium", "high"),
        help="how long a model in the harmony format (gpt-oss) reasons, with --chat; --json "
        "shows its reasoning and calls (default: the format's, medium)",
    )
    constrain = parser.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema",
        type=json_schema_text,
        metavar="SCHEMA",
        help="the output is JSON valid under this JSON Schema (its text, or @FILE)",
    )
    constrain.add_argument(
        "--regex", metavar="RE", help="the output is a whole match of this regular expression"
    )
    constrain.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="the output is one of these (repeatable; default: unconstrained)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop string (repeatable; default: none)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="print tokens as they arrive (default: off)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result as one JSON object (with --stream: one line per chunk first; "
        "default: off, the text)",
    )
    parser.add_argument(
        "--timeout",
        type=_timeout_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"give up on the answer after S seconds (default: {DEFAULT_TIMEOUT_S:g}; 0 or "
        "inf: wait forever)",
    )


def _logit_bias(text: str) -> tuple[int, float]:
    """``ID=BIAS`` as ``(ID, BIAS)``; the daemon checks both ranges."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def json_schema_text(text: str) -> str:
    """A JSON Schema's text, given inline or as ``@FILE``; it must parse as JSON."""
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text[1:]}: {exc.strerror}") from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    return text


def _grammar(args: argparse.Namespace) -> Grammar | None:
    if args.json_schema is not None:
        return Grammar("json_schema", args.json_schema)
    if args.regex is not None:
        return Grammar("regex", args.regex)
    if args.choice:
        return Grammar("choice", choices=args.choice)
    return None


def run_generate(args: argparse.Namespace) -> int:
    """Run ``outrider generate``; returns the exit status (1: the request failed)."""
    if args.prompt in (None, "-"):
        if args.prompt is None and sys.stdin.isatty():
            print("error: give a PROMPT, or '-' to read it from stdin", file=sys.stderr)
            return 2
        prompt = sys.stdin.read()
    else:
        prompt = args.prompt
    # None (a flag not given) leaves the value to the daemon's defaults.
    request: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "min_p": args.min_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "logit_bias": dict(args.logit_bias),
        "grammar": _grammar(args),
        "max_drafts": args.max_drafts,
        "reasoning_effort": args.reasoning_effort,
    }
    if args.chat:
        request["messages"] = [{"role": "user", "content": prompt}]
    else:
        request["prompt"] = prompt
    endpoint = args.connect if args.connect is not None else default_endpoint()
    path = ipc_path(endpoint)
    if path is not None and not os.path.exists(path):  # no daemon: said at once
        print(f"error: {not_listening_reason(endpoint)}", file=sys.stderr)
        return 1
    timeout: float | None = args.timeout
    health_deadline = HEALTH_DEADLINE_S if timeout is None else min(HEALTH_DEADLINE_S, timeout)
    try:
        with Client(endpoint, timeout=timeout) as client:
            # NOTE: with no daemon bound, ZeroMQ would hold the request until the deadline;
            # the health check ends that within seconds, saying which failure it was.
            client.health(timeout=health_deadline)
            try:
                if args.stream:
                    result = _print_stream(client.stream(**request), as_json=args.json)
                else:
                    result = client.generate(**request)
                    print(_json_line(result) if args.json else result.text)
            except NotListening:
                raise  # the daemon went away: said as the health check says it
            except Timeout:
                assert timeout is not None, "without a deadline no call times out"
                if args.stream and not args.json:
                    print()  # end the partial text's line
                print(
                    f"error: timeout: no complete answer within {timeout:g} s; the request was "
                    "aborted (--timeout S waits longer, 0 waits forever)",
                    file=sys.stderr,
                )
                return 1
    except RequestError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if result.finish_reason == "abort":
        print(
            f"error: aborted: the daemon ended the request after {result.usage.completion_tokens} "
            "tokens, before it was complete (a shutdown drain, or an abort)",
            file=sys.stderr,
        )
        return 1
    return 0


def _timeout_seconds(text: str) -> float | None:
    """``--timeout``: seconds, None (0 or inf) for no limit."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return None if seconds == 0 or math.isinf(seconds) else seconds


def _print_stream(stream: TokenStream, *, as_json: bool) -> GenerateResult:
    """Print ``stream`` as it arrives; its final frame."""
    out = sys.stdout
    for chunk in stream:
        out.write(_json_line(chunk) + "\n" if as_json else chunk.text)
        out.flush()
    assert stream.result is not None, "a stream that ends without an error has its result"
    out.write(_json_line(stream.result) + "\n" if as_json else "\n")
    out.flush()
    return stream.result


def _json_line(value: msgspec.Struct | None) -> str:
    return msgspec.json.encode(_named(value)).decode()


def _named(value: Any) -> Any:
    """``value`` as builtins, every struct as an object keyed by field name (the wire's
    ``array_like`` structs, such as ``Usage``, included)."""
    if isinstance(value, msgspec.Struct):
        return {name: _named(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, list | tuple):
        return [_named(item) for item in value]
    return value
