"""The ``outrider`` command against a real daemon: ``generate --chat`` goes through the model's
chat template, the start is free of misleading warnings, and a second SIGINT stops at once."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import Daemon, build_model_dir, poll_until

from outrider.daemon.cli.main import main
from outrider.daemon.processes.server import EXIT_INTERRUPTED
from outrider.daemon.tokenizer import load_tokenizer
from outrider.protocol import Client


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def daemon(model_dir: Path, tmp_path: Path) -> Iterator[Daemon]:
    started = Daemon(model_dir, tmp_path / "daemon")
    try:
        started.wait_serving()
        yield started
    finally:
        started.kill_all()


def _prompt_tokens(capsys: pytest.CaptureFixture[str], *argv: str) -> int:
    """``usage.prompt_tokens`` of ``outrider generate --json ARGV``."""
    assert main(["generate", "--json", "--max-new-tokens", "2", *argv]) == 0
    count: int = json.loads(capsys.readouterr().out)["usage"]["prompt_tokens"]
    return count


@pytest.mark.e2e
def test_generate_chat_then_a_second_sigint_stops_at_once(
    daemon: Daemon, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer is not None
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert len(chat_ids) > len(tokenizer.encode_prompt("hello"))
    assert _prompt_tokens(capsys, "--connect", daemon.endpoint, "--chat", "hello") == len(chat_ids)
    raw_ids = tokenizer.encode_prompt("hello")
    assert _prompt_tokens(capsys, "--connect", daemon.endpoint, "hello") == len(raw_ids)

    # The children import transformers without torch on purpose: no advisory about it.
    assert "PyTorch was not found" not in daemon.log()
    assert "torch threads: " in daemon.log()
    assert " start-up objects frozen (a full collection walked them in " in daemon.log()

    with Client(daemon.endpoint, timeout=30) as client:
        stream = client.stream(
            input_ids=[5, 6, 7], max_new_tokens=2000, ignore_eos=True, temperature=0
        )
        assert next(stream).token_ids
        daemon.send_signal(signal.SIGINT)
        said = "SIGINT: draining: 1 running, 0 waiting, for at most 60 s (--drain-timeout); "
        said += "a second SIGINT (Ctrl-C) stops at once"
        poll_until(lambda: said in daemon.log(), 10, "the drain announced")
        assert next(stream).token_ids  # the drain lets it run on
        daemon.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        list(stream)
        assert stream.result is not None and stream.result.finish_reason == "abort"
        assert len(stream.result.output_ids) < 2000
    assert daemon.wait_exit(10) == EXIT_INTERRUPTED == 130
    daemon.wait_group_gone()
    assert time.monotonic() - interrupted < 10
    log = daemon.log()
    assert "SIGINT during the drain: aborting 1 running and 0 waiting requests, stopping now" in log
    assert "Traceback" not in log
