"""The ``outrider`` command itself (its subcommands have their own test files)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest

from outrider.daemon.cli import generate as generate_cmd
from outrider.daemon.cli.main import build_parser, main
from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.flags import add_serve_arguments, flag_name, flag_table, resolve
from outrider.daemon.processes.placement import available_cpus, torch_threads
from outrider.protocol import Timeout
from outrider.protocol.messages import PROTOCOL_VERSION, Grammar


def test_version_names_the_installed_distribution_and_the_protocol(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    installed = importlib.metadata.version("outrider")
    assert (
        capsys.readouterr().out == f"outrider {installed} (client protocol {PROTOCOL_VERSION}.4)\n"
    )


@pytest.mark.parametrize(
    ("argv", "refused", "hint"),
    [
        (["serve", "--port", "8000"], "--port 8000", "--port: did you mean --http HOST:PORT?"),
        (
            ["serve", "--max-model-len=4096"],
            "--max-model-len=4096",
            "--max-model-len: did you mean --context-length N?",
        ),
        # 16 is taken for the PROMPT: argparse reads positionals between unknown flags.
        (
            ["generate", "--max-tokens", "16", "hi"],
            "--max-tokens hi",
            "--max-tokens: did you mean --max-new-tokens N?",
        ),
        (["generate", "--port", "8000"], "--port", "--port: did you mean --connect ENDPOINT?"),
        (["bench", "latency", "-tp", "2"], "-tp 2", "-tp: did you mean --tp N?"),
    ],
)
def test_foreign_flags_get_the_subcommand_usage_and_a_hint(
    capsys: pytest.CaptureFixture[str], argv: list[str], refused: str, hint: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    prog = "outrider " + " ".join(argv[: 2 if argv[0] == "bench" else 1])
    assert err.startswith(f"usage: {prog} ")
    assert err.endswith(f"{prog}: error: unrecognized arguments: {refused}\n  {hint}\n")


def test_an_unknown_flag_without_a_hint_is_refused_under_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: outrider serve ")
    assert err.endswith("outrider serve: error: unrecognized arguments: --bogus\n")


# --- serve --help and the README's flag table ---------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    actions = build_parser()._actions
    commands = next(a for a in actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def test_every_serve_flag_has_help_with_its_default() -> None:
    parser = _serve_parser()
    flags = {
        action.option_strings[-1]: action.help or ""
        for action in parser._actions
        if action.option_strings and action.dest not in ("help", "help_markdown")
    }
    assert set(flags) == {flag_name(f.name) for f in dataclasses.fields(ServeConfig)}
    for flag, text in flags.items():
        assert text and "(default: " in text and "[env OUTRIDER_" in text, flag
    assert "(default: the embedded family)" in flags["--model"]
    assert "(default: automatic)" in flags["--threads"]
    assert "(default: 0600)" in flags["--socket-mode"]
    assert "(default: off)" in flags["--no-overlap"]
    usage = parser.format_help()
    assert "Without --model it serves the embedded model family" in usage
    assert "with DFlash speculation" in usage


def test_the_readme_flag_table_is_the_generated_one(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    begin, end = "<!-- serve flags: begin -->\n", "<!-- serve flags: end -->"
    assert begin in readme and end in readme, "the README lost its flag table markers"
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == flag_table(), "regenerate it: outrider serve --help-markdown"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help-markdown"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == flag_table()
    rows = [line for line in flag_table().splitlines() if line.startswith("| `--")]
    assert len(rows) == len(dataclasses.fields(ServeConfig))
    assert "| `--load-format auto\\|dummy` | auto | auto: weights from the directory;" in table


# --- --threads ----------------------------------------------------------------------------


def test_threads_leave_a_core_to_the_children_unless_given() -> None:
    config = ServeConfig(model="m")
    assert [torch_threads(config, cpus) for cpus in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert torch_threads(dataclasses.replace(config, threads=2), cpus=2) == 2
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    resolved = resolve(parser.parse_args(["--model", "/m", "--threads", "3"]), environ={})
    assert resolved.threads == 3
    assert resolve(parser.parse_args(["--model", "/m"]), {"OUTRIDER_THREADS": "2"}).threads == 2
    with pytest.raises(ConfigError, match="--threads must be >= 0"):
        resolve(parser.parse_args(["--model", "/m", "--threads", "-1"]), environ={})


def test_the_longest_prompt_run_is_a_count_from_zero() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert resolve(parser.parse_args(["--model", "/m"]), environ={}).max_prompt_run == 0
    given = resolve(parser.parse_args(["--model", "/m", "--max-prompt-run", "2"]), environ={})
    assert given.max_prompt_run == 2
    with pytest.raises(ConfigError, match="--max-prompt-run must be at least 0"):
        resolve(parser.parse_args(["--model", "/m", "--max-prompt-run", "-1"]), environ={})


@pytest.mark.parametrize(
    "listen", ["TCP://0.0.0.0:5555", "Ipc:///tmp/x.sock", "inproc://x", "ws://127.0.0.1:1", "/x"]
)
def test_a_listen_endpoint_libzmq_cannot_bind_is_refused_before_loading(listen: str) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    with pytest.raises(ConfigError, match=r"expected ipc://PATH or tcp://HOST:PORT"):
        resolve(parser.parse_args(["--model", "/m", "--listen", listen]), environ={})
    for good in ("tcp://127.0.0.1:5555", "ipc:///tmp/x.sock"):
        assert resolve(parser.parse_args(["--model", "/m", "--listen", good]), {}).listen == good


# --- generate: --chat and the timeout -------------------------------------------------------


class _FakeClient:
    """Answers health, records the generate call, then times out like a daemon that does not
    answer within the deadline."""

    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, endpoint: str, timeout: float | None = None) -> None:
        self.timeout = timeout

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def health(self, timeout: float | None = None) -> None:
        pass

    def generate(self, prompt: str | None = None, **kwargs: Any) -> None:
        self.calls.append({"prompt": prompt, "timeout": self.timeout, **kwargs})
        raise Timeout("the daemon at ipc://x did not answer in time", "r1")


def test_generate_chat_sends_one_user_message_and_the_timeout_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(generate_cmd, "Client", _FakeClient)
    _FakeClient.calls.clear()
    # A tcp:// endpoint: generate checks an ipc:// one's socket file before any client exists.
    fake = ["--connect", "tcp://127.0.0.1:9"]
    assert main(["generate", *fake, "--chat", "hello there"]) == 1
    assert main(["generate", *fake, "--timeout", "2.5", "plain"]) == 1
    chat, plain = _FakeClient.calls
    assert chat["prompt"] is None and chat["messages"] == [
        {"role": "user", "content": "hello there"}
    ]
    assert chat["timeout"] == generate_cmd.DEFAULT_TIMEOUT_S == 300
    assert plain["prompt"] == "plain" and "messages" not in plain and plain["timeout"] == 2.5
    assert capsys.readouterr().err.splitlines() == [
        "error: timeout: no complete answer within 300 s; the request was aborted "
        "(--timeout S waits longer, 0 waits forever)",
        "error: timeout: no complete answer within 2.5 s; the request was aborted "
        "(--timeout S waits longer, 0 waits forever)",
    ]


def test_generate_passes_the_logit_adjustments_the_draft_cap_and_the_reasoning_effort(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(generate_cmd, "Client", _FakeClient)
    _FakeClient.calls.clear()
    fake = ["--connect", "tcp://127.0.0.1:9"]
    adjusted = ["--min-p", "0.05", "--presence-penalty", "1.5", "--frequency-penalty", "-0.5"]
    adjusted += ["--repetition-penalty", "1.2", "--logit-bias", "7=100", "--logit-bias", "9=-2.5"]
    assert main(["generate", *fake, *adjusted, "x"]) == 1
    assert main(["generate", *fake, "y"]) == 1
    given, plain = _FakeClient.calls
    names = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    assert [given[n] for n in names] == [0.05, 1.5, -0.5, 1.2, {7: 100.0, 9: -2.5}]
    assert [plain[n] for n in names] == [0.0, 0.0, 0.0, 1.0, {}]
    assert main(["generate", *fake, "--max-drafts", "0", "z"]) == 1
    assert (_FakeClient.calls[-1]["max_drafts"], plain["max_drafts"]) == (0, None)
    assert main(["generate", *fake, "--chat", "--reasoning-effort", "high", "z"]) == 1
    assert (_FakeClient.calls[-1]["reasoning_effort"], plain["reasoning_effort"]) == ("high", None)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["generate", *fake, "--logit-bias", "7", "x"])
    assert "expected ID=BIAS, got '7'" in capsys.readouterr().err


def test_generate_sends_the_grammar_it_is_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(generate_cmd, "Client", _FakeClient)
    _FakeClient.calls.clear()
    fake = ["--connect", "tcp://127.0.0.1:9"]
    schema = '{"type": "object"}'
    (tmp_path / "schema.json").write_text(schema)
    assert main(["generate", *fake, "--json-schema", schema, "x"]) == 1
    assert main(["generate", *fake, "--json-schema", f"@{tmp_path / 'schema.json'}", "x"]) == 1
    assert main(["generate", *fake, "--regex", "[0-9]+", "x"]) == 1
    assert main(["generate", *fake, "--choice", "yes", "--choice", "no", "x"]) == 1
    assert main(["generate", *fake, "x"]) == 1
    assert [call["grammar"] for call in _FakeClient.calls] == [
        Grammar("json_schema", schema),
        Grammar("json_schema", schema),
        Grammar("regex", "[0-9]+"),
        Grammar("choice", choices=["yes", "no"]),
        None,
    ]
    capsys.readouterr()
    for argv, error in (
        (["--json-schema", "{"], "--json-schema: not JSON: "),
        (["--json-schema", "@/nonexistent.json"], "--json-schema: cannot read /nonexistent.json"),
        (["--regex", "a", "--choice", "b"], "--choice: not allowed with argument --regex"),
    ):
        with pytest.raises(SystemExit):
            main(["generate", *fake, *argv, "x"])
        assert error in capsys.readouterr().err
