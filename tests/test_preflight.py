"""Start-up checks that load nothing: daemon/processes/preflight.py (model, draft and key
files) and the serve flags of access control in daemon/frontdoor/flags.py (--socket-mode, the
CURVE pair)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zmq.auth
from safetensors.torch import save_file

from outrider.daemon.config import EXIT_CONFIG, ConfigError, ServeConfig
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.processes.preflight import model_problems, preflight


def _resolve(*argv: str, environ: dict[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve(parser.parse_args(["--model", "/m", *argv]), environ=environ or {})


def _model(directory: Path, *weights: str) -> Path:
    """A model directory; each ``*.safetensors`` of ``weights`` a whole file of one tensor,
    anything else empty."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    for name in weights:
        if name.endswith(".safetensors"):
            save_file({"w": torch.zeros(4)}, str(directory / name))
        else:
            (directory / name).write_bytes(b"")
    return directory


def test_a_model_directory_with_weights_passes(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", "model.safetensors")
    assert model_problems("--model", str(model), "auto") == []
    assert model_problems("--model", str(model / "config.json"), "auto") == []


def test_dummy_weights_need_only_a_config(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    assert model_problems("--model", str(model), "dummy") == []
    assert model_problems("--model", str(model / "config.json"), "dummy") == []


def test_model_refusals_name_the_flag_and_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = _model(tmp_path / "no-weights")
    pickled = _model(tmp_path / "pickled", "pytorch_model.bin")
    bad_json = _model(tmp_path / "bad-json", "model.safetensors")
    (bad_json / "config.json").write_text("{")
    bad_generation = _model(tmp_path / "bad-generation", "model.safetensors")
    (bad_generation / "generation_config.json").write_text("[1, 2")
    sharded = _model(tmp_path / "sharded", "a.safetensors")
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    cases = {
        tmp_path / "nope": "no such file or directory",
        empty: "no config.json in the directory",
        no_weights: "no *.safetensors weights (--load-format dummy runs without them)",
        pickled: "no *.safetensors weights (--load-format dummy runs without them); *.bin "
        "checkpoints are not read: convert them to safetensors",
        bad_json: "config.json is not JSON",
        bad_generation: "generation_config.json is not JSON",
        sharded: "model.safetensors.index.json names missing shards: b.safetensors",
    }
    for path, reason in cases.items():
        assert model_problems("--draft-model", str(path), "auto") == [
            f"--draft-model {path}: {reason}"
        ]


def test_an_unsupported_target_names_what_is_supported(tmp_path: Path) -> None:
    model = _model(tmp_path / "moe", "model.safetensors")
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    (model / "config.json").write_text(json.dumps(config))
    assert preflight(ServeConfig(model=str(model))) == [
        f"--model {model}: model_type 'deepseek_v3' is not supported "
        "(supported: gpt_oss, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe)"
    ]
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}
    (model / "config.json").write_text(json.dumps(config))
    assert preflight(ServeConfig(model=str(model))) == [
        f"--model {model}: architecture 'Qwen3ForSequenceClassification' is not supported "
        "(supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM)"
    ]


def test_a_truncated_safetensors_file_is_named(tmp_path: Path) -> None:
    whole = _model(tmp_path / "whole", "model.safetensors")
    assert model_problems("--model", str(whole), "auto") == []
    cut = _model(tmp_path / "cut", "model.safetensors")
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 3)
    assert model_problems("--model", str(cut), "auto") == [
        f"--model {cut}: model.safetensors is truncated: {size - 3} bytes of the {size} its "
        "header describes"
    ]
    os.truncate(weights, 5)
    assert model_problems("--model", str(cut), "auto") == [
        f"--model {cut}: model.safetensors is truncated or not safetensors (5 bytes)"
    ]
    sharded = _model(tmp_path / "sharded", "a.safetensors", "b.safetensors")
    index = {"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "b.safetensors").write_bytes(b"\x04" + b"\x00" * 7 + b"[1]x")
    assert model_problems("--model", str(sharded), "auto") == [
        f"--model {sharded}: b.safetensors has no readable safetensors header"
    ]


def test_outrider_serve_refuses_a_truncated_file_before_loading(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", "model.safetensors")
    (model / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
    )
    os.truncate(model / "model.safetensors", 20)
    argv = ["serve", "--model", str(model), "--device", "cpu", "--speculative-algorithm", "none"]
    done = subprocess.run(
        [sys.executable, "-m", "outrider.daemon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.splitlines() == [
        f"outrider serve: --model {model}: model.safetensors is truncated or not safetensors "
        "(20 bytes)"
    ]


def test_preflight_reports_every_problem_at_once(tmp_path: Path) -> None:
    _, secret = zmq.auth.create_certificates(tmp_path, "server")
    os.chmod(secret, 0o644)
    config = ServeConfig(
        model=str(tmp_path / "missing"),
        draft_model=str(tmp_path),
        curve_secret_key_file=secret,
        curve_client_keys=str(tmp_path / "clients"),
        step_log=str(tmp_path / "no-such-dir" / "steps.jsonl"),
    )
    assert preflight(config) == [
        f"--model {tmp_path / 'missing'}: no such file or directory",
        f"--draft-model {tmp_path}: no config.json in the directory",
        f"--curve-secret-key-file {secret}: mode 0644 lets other users at the secret key; "
        "chmod 600 it",
        f"--curve-client-keys {tmp_path / 'clients'}: no such file or directory",
        f"--step-log {tmp_path / 'no-such-dir' / 'steps.jsonl'}: cannot append to it: "
        "No such file or directory",
    ]


@pytest.mark.parametrize(("raw", "mode"), [("0600", 0o600), ("660", 0o660), ("0o640", 0o640)])
def test_socket_mode_is_octal(raw: str, mode: int) -> None:
    assert _resolve("--socket-mode", raw).socket_mode == mode
    assert _resolve(environ={"OUTRIDER_SOCKET_MODE": raw}).socket_mode == mode
    assert _resolve().socket_mode == 0o600


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("0666", "--socket-mode 0666: only owner and group read/write bits"),
        ("0700", "--socket-mode 0700: only owner and group read/write bits"),
        ("rw", "--socket-mode: expected an octal mode such as 0660, got 'rw'"),
    ],
)
def test_socket_mode_beyond_owner_and_group_is_refused(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _resolve("--socket-mode", raw)


def test_curve_needs_both_the_secret_key_and_the_client_keys() -> None:
    with pytest.raises(ConfigError) as refused:
        _resolve("--curve-secret-key-file", "/k")
    assert str(refused.value) == (
        "--curve-secret-key-file needs --curve-client-keys DIR (the client public "
        "certificates allowed in)"
    )
    with pytest.raises(ConfigError, match="--curve-client-keys needs --curve-secret-key-file"):
        _resolve("--curve-client-keys", "/d")
    config = _resolve("--curve-secret-key-file", "/k", "--curve-client-keys", "/d")
    assert (config.curve_secret_key_file, config.curve_client_keys) == ("/k", "/d")
