"""``outrider bench serve`` for a few seconds against the embedded family on CPU, over both
transports (ZeroMQ and OpenAI HTTP), and its ShareGPT reader on a cut-off file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from http_harness import API_KEY, FAMILY, HttpDaemon

from outrider.daemon.bench.serve_data import (
    LengthsDoNotFit,
    RandomLengths,
    fit_random_lengths,
    iter_complete_elements,
    longest_draw,
    sharegpt_requests,
)
from outrider.daemon.cli.main import main
from outrider.daemon.tokenizer import load_tokenizer

NUM_PROMPTS = 5
REPLY = "Far to the south, past the hills and the old town."


@pytest.fixture(scope="module")
def server(family_http: HttpDaemon) -> HttpDaemon:
    return family_http


def _transport(server: HttpDaemon, backend: str) -> list[str]:
    """``bench serve``'s arguments that reach ``server`` over ``backend``."""
    if backend == "zmq":
        return ["--endpoint", server.daemon.endpoint]
    assert FAMILY is not None
    return ["--base-url", server.base, "--api-key", API_KEY, "--tokenizer", str(FAMILY.target)]


@pytest.mark.e2e
@pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed")
@pytest.mark.parametrize("backend", ["zmq", "openai"])
def test_bench_serve_over_both_transports(
    server: HttpDaemon, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert FAMILY is not None
    result_path = tmp_path / "result.json"
    argv = [
        "bench", "serve", "--backend", backend, "--dataset", "random",
        "--random-input-len", "12", "--random-output-len", "6", "--random-range-ratio", "0.5",
        "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "3", "--request-rate", "50",
        "--seed", "3", "--result-json", str(result_path),
    ]  # fmt: skip
    argv += _transport(server, backend)
    before = time.time()
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert " Serving Benchmark Result ".center(50, "=") in report
    # The timed run began after the untimed first request and at least its duration ago.
    result = json.loads(result_path.read_text())
    assert before < result["started_at"] <= time.time() - result["duration"]
    assert "Successful requests:                     5" in report
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
    expected = result["expected_output_lens"]
    assert len(set(expected)) > 1 and all(3 <= n <= 9 for n in expected)  # random lengths
    assert result["output_lens"] == expected
    assert result["total_output_tokens"] == sum(expected)
    assert result["total_input_tokens"] == sum(result["input_lens"])
    # One ITL gap per output after the first: at most one per token after the first.
    assert all(0 < len(itl) <= n - 1 for itl, n in zip(result["itls"], expected, strict=True))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]


SCHEMA = Path(__file__).parent.parent / "benchmarks" / "structured" / "review.schema.json"


@pytest.mark.e2e
@pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed")
@pytest.mark.parametrize("backend", ["zmq", "openai"])
def test_bench_serve_sends_a_json_schema(
    server: HttpDaemon, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request constrained by the repository's workload schema: each ends where its
    JSON does (its stop token counted) or at its output length, none fails."""
    assert FAMILY is not None
    result_path = tmp_path / "result.json"
    argv = [
        "bench", "serve", "--backend", backend, "--random-input-len", "16",
        "--random-output-len", "160", "--num-prompts", "4", "--max-concurrency", "2",
        "--temperature", "1.0", "--json-schema", f"@{SCHEMA}", "--result-json", str(result_path),
    ]  # fmt: skip
    argv += _transport(server, backend)
    assert main(argv) == 0
    capsys.readouterr()
    result = json.loads(result_path.read_text())
    assert result["completed"] == 4 and result["failed"] == 0
    assert json.loads(result["json_schema"]) == json.loads(SCHEMA.read_text())
    assert all(0 < n <= 160 for n in result["output_lens"])


@pytest.mark.e2e
@pytest.mark.skipif(FAMILY is None, reason="the embedded family is not installed")
def test_bench_serve_defaults_fit_the_served_context(
    server: HttpDaemon, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_path = tmp_path / "result.json"
    endpoint = ["--endpoint", server.daemon.endpoint]
    argv = ["bench", "serve", *endpoint, "--num-prompts", "2", "--result-json", str(result_path)]
    assert main(argv) == 0
    result = json.loads(result_path.read_text())
    context = result["server"]["configuration"]["context_length"]
    assert result["failed"] == 0 and result["output_lens"] == result["expected_output_lens"]
    assert max(result["input_lens"]) + max(result["output_lens"]) <= context
    capsys.readouterr()
    # Lengths given that cannot fit are refused before any request is sent.
    assert main(["bench", "serve", *endpoint, "--random-input-len", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"do not fit the served context length of {context}" in err


def test_random_lengths_left_out_are_sized_to_fit_the_context() -> None:
    assert fit_random_lengths(None, None, None, 0.0) == RandomLengths(1024, 128)
    assert fit_random_lengths(4096, None, None, 0.5) == RandomLengths(1024, 128)
    assert fit_random_lengths(512, None, None, 0.0) == RandomLengths(384, 128)
    assert fit_random_lengths(512, 300, None, 0.0) == RandomLengths(300, 128)
    assert fit_random_lengths(512, None, 400, 0.0) == RandomLengths(112, 400)
    for context, ratio in [(512, 0.5), (64, 0.0), (100, 0.9), (8, 0.3)]:
        lengths = fit_random_lengths(context, None, None, ratio)
        longest = longest_draw(lengths.input_len, ratio) + longest_draw(lengths.output_len, ratio)
        assert longest <= context and lengths.input_len > lengths.output_len
    with pytest.raises(LengthsDoNotFit, match="--random-input-len 1024 with"):
        fit_random_lengths(512, 1024, None, 0.0)
    with pytest.raises(LengthsDoNotFit, match=r"up to 600 tokens .* context length of 512"):
        fit_random_lengths(512, 400, 200, 0.5)


def test_sharegpt_reads_the_complete_records_of_a_cut_off_file(tmp_path: Path) -> None:
    assert FAMILY is not None
    records = [
        {"id": str(i), "conversations": [
            {"from": "human", "value": f"Question {i}: where does the river meet the sea?"},
            {"from": "gpt", "value": REPLY},
        ]}
        for i in range(6)
    ]  # fmt: skip
    records.insert(2, {"id": "single", "conversations": [{"from": "human", "value": "Hi"}]})
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"Question 5')]  # inside the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    assert [r["id"] for r in iter_complete_elements(path)] == ["0", "1", "single", "2", "3", "4"]
    tokenizer = load_tokenizer(FAMILY.target)
    assert tokenizer is not None
    picked = sharegpt_requests(tokenizer, 3, 0, path, None, None)
    reply_len = len(tokenizer.encode_prompt(REPLY))
    assert len(picked) == 3 and all(r.prompt and r.prompt.startswith("Question") for r in picked)
    assert all(r.output_len == reply_len and r.prompt_ids is None for r in picked)
    with pytest.raises(ValueError, match="only 5 ShareGPT"):
        sharegpt_requests(tokenizer, 6, 0, path, 8, None)


def test_backend_openai_without_httpx_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx raises ImportError
    assert main(["bench", "serve", "--backend", "openai", "--tokenizer", "unused"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "outrider bench serve: --backend openai needs httpx: pip install 'outrider[bench]'\n"
    )
