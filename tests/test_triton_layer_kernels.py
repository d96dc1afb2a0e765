"""The Triton kernels that graphs being built run (``plugins/models/triton_kernels.py``,
``plugins/kv_store.py``, ``plugins/greedy_kernel.py``), and the sampled rows' race that every
GPU step runs (``plugins/race_kernel.py``), against what they replace: the GEMV against
``F.linear``, SiLU-and-multiply and Qwen3's q/k norm with the rotation against the reference
kernels, the down projection with SiLU-and-multiply fused against the two kernels, the K/V
store against ``index_copy_``, the greedy token and its logprob against torch's, the race's
winners against torch's.
Without a GPU they run in Triton's interpreter on CPU tensors (float32: the interpreter has no
bfloat16); ``test_layer_kernels.py`` covers them compiled, in bf16."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from outrider.plugins.device import AttentionShape, KVCache, heads_contiguous
from outrider.plugins.models.config import ModelConfig
from outrider.plugins.models.kernels import TORCH_KERNELS
from outrider.plugins.models.layers import RotaryEmbedding

CUDA = torch.cuda.is_available()  # without one, conftest.py runs Triton's interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'outrider[triton]')",
)

ROPE = ModelConfig.from_dict(
    {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    }
).rope


def _gen() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(0)


def test_the_gemv_is_f_linear_for_one_row() -> None:
    from outrider.plugins.models import triton_kernels

    gen = _gen()
    # Rows past a program's 8 and short of it; K short of a step and past one.
    for n, k in ((13, 40), (5, 1100)):
        x = torch.randn(3, k, generator=gen, device=DEVICE)
        weight = torch.randn(n, k, generator=gen, device=DEVICE)
        bias = torch.randn(n, generator=gen, device=DEVICE)
        for b in (None, bias):
            got = triton_kernels.gemv(x[:1], weight, b)
            torch.testing.assert_close(got, F.linear(x[:1], weight, b), rtol=1e-5, atol=1e-4)
    # One row, contiguous along K, one dtype: nothing else takes the GEMV.
    row, weight = torch.zeros(1, 8), torch.zeros(4, 8)
    assert triton_kernels.gemv_fits(row, weight)
    assert not triton_kernels.gemv_fits(torch.zeros(2, 8), weight)
    assert not triton_kernels.gemv_fits(torch.zeros(8, 2)[:, :1].t(), weight)
    assert not triton_kernels.gemv_fits(row, torch.zeros(8, 4).t())
    assert not triton_kernels.gemv_fits(row.half(), weight)


def test_silu_and_mul_matches_the_reference() -> None:
    from outrider.plugins.models import triton_kernels

    gen = _gen()
    for tokens, width in ((1, 600), (3, 40), (0, 16)):
        gate_up = torch.randn(tokens, 2 * width, generator=gen, device=DEVICE)
        got = triton_kernels.silu_and_mul(gate_up)
        assert got.shape == (tokens, width)
        torch.testing.assert_close(got, TORCH_KERNELS.silu_and_mul(gate_up))


def test_the_fused_down_projection_is_silu_and_mul_then_the_gemv() -> None:
    from outrider.plugins.models import triton_kernels

    gen = _gen()
    for n, k in ((13, 40), (5, 1100)):
        gate_up = 3 * torch.randn(1, 2 * k, generator=gen, device=DEVICE)
        weight = torch.randn(n, k, generator=gen, device=DEVICE)
        bias = torch.randn(n, generator=gen, device=DEVICE)
        for b in (None, bias):
            got = triton_kernels.silu_mul_gemv(gate_up, weight, b)
            # The same products in the same order: bit for bit the two kernels' result.
            unfused = triton_kernels.gemv(triton_kernels.silu_and_mul(gate_up), weight, b)
            assert torch.equal(got, unfused)
            ref = TORCH_KERNELS.silu_mul_linear(gate_up, weight, b)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_q_k_norm_and_rotation_match_the_reference() -> None:
    from outrider.plugins.models import triton_kernels

    gen = _gen()
    tokens, q_heads, kv_heads, dim = 3, 4, 2, 16
    table = RotaryEmbedding(dim, ROPE, max_positions=64).to(DEVICE)
    table.init_table()
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen, device=DEVICE)
    before = qkv.clone()
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    q_weight = 1 + 0.1 * torch.randn(dim, generator=gen, device=DEVICE)
    k_weight = 1 + 0.1 * torch.randn(dim, generator=gen, device=DEVICE)
    positions = torch.tensor([0, 9, 63], device=DEVICE)
    got_q, got_k = triton_kernels.qk_norm_rope(
        q, k, q_weight, k_weight, 1e-6, positions, table.cos_sin_float32()
    )
    ref_q, ref_k = TORCH_KERNELS.qk_norm_rotate(
        q, k, q_weight, k_weight, 1e-6, TORCH_KERNELS.rotation(table, positions)
    )
    assert torch.equal(qkv, before)  # new tensors: the projection is left alone
    assert heads_contiguous(q) and heads_contiguous(k)
    assert not heads_contiguous(q.transpose(1, 2))
    torch.testing.assert_close(got_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-5, atol=1e-5)


def test_the_kv_store_writes_what_index_copy_does() -> None:
    from outrider.plugins.kv_store import store_kv

    gen = _gen()
    q_heads, kv_heads, dim, tokens = 4, 2, 16, 5
    shape = AttentionShape(q_heads, kv_heads, dim, dim**-0.5, torch.float32)
    caches = [KVCache.allocate(1, 4, 4, shape, torch.float32, DEVICE) for _ in range(2)]
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen, device=DEVICE)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    loc = torch.randperm(16, generator=gen, device=DEVICE)[:tokens]
    caches[0].store(0, loc, k, v)  # eagerly: index_copy_
    store_kv(caches[1].k[0], caches[1].v[0], loc, k, v)
    assert torch.equal(caches[0].k[0], caches[1].k[0])
    assert torch.equal(caches[0].v[0], caches[1].v[0])
    assert caches[1].k[0].count_nonzero() == tokens * kv_heads * dim


def test_the_greedy_kernel_is_torch_argmax_and_log_softmax() -> None:
    from outrider.plugins import greedy_kernel

    gen = _gen()
    # A vocabulary of several chunks and a partial last one, read through a row stride wider
    # than it (the sampler slices padded ids off).
    rows, vocab = 4, 5000
    padded = torch.randn(rows, vocab + 24, generator=gen, device=DEVICE)
    logits = padded[:, :vocab]
    logits[1, 4999] = 9.0  # the maximum in the partial chunk
    logits[2, [7, 3000, 4100]] = 8.0  # equal maxima in three chunks: the lowest id wins
    logits[3, [2050, 2060]] = 8.0  # equal maxima in one chunk
    logits[3, 4096:] = float("-inf")  # a chunk with nothing but masked ids
    tokens, logprob = greedy_kernel.greedy_logprob(logits)
    assert tokens.tolist()[1:] == [4999, 7, 2050]
    assert torch.equal(tokens, logits.argmax(dim=-1))
    expected = logits.gather(-1, tokens[:, None]).squeeze(-1) - logits.logsumexp(dim=-1)
    torch.testing.assert_close(logprob, expected, rtol=0, atol=1e-5)
    empty_tokens, empty_logprob = greedy_kernel.greedy_logprob(logits[:0])
    assert empty_tokens.shape == empty_logprob.shape == (0,)
    assert greedy_kernel.greedy_fits(logits.to(DEVICE)) == CUDA


def test_kernels_on_cpu_tensors_launch_without_pdl() -> None:
    from outrider.plugins.triton_launch import pdl_options

    # Triton's interpreter has no dependent launch: its kernels take PDL off.
    assert pdl_options(torch.device("cpu")) == {"PDL": False}


def test_the_race_kernel_is_torch_race() -> None:
    """The fused race (``plugins/race_kernel.py``) against torch's operations
    (``sampling._race_torch``): the same winning id in every row, across several chunks and a
    partial last one, read through a row stride wider than the vocabulary, with cut tokens
    (-inf) and a row where one token alone is left."""
    from outrider.plugins import race_kernel, sampling

    gen = _gen()
    rows, vocab = 24, 5000
    padded = torch.randn(rows, vocab + 24, generator=gen, device=DEVICE) * 3.0
    values = padded[:, :vocab]
    values[1, :4000] = float("-inf")  # the winner in the partial last chunk's neighbourhood
    values[2, :] = float("-inf")
    values[2, 4321] = 0.0  # one token left
    seeds = torch.arange(rows, device=DEVICE) * 7919
    keys = sampling._row_keys(seeds, torch.arange(rows, device=DEVICE), 3)
    won = race_kernel.race_winners(values, keys, sampling.MIXERS)
    assert won.shape == (rows, 1) and won.dtype == torch.int64
    assert torch.equal(won, sampling._race_torch(values, keys))
    assert won[2, 0] == 4321  # the one token left
    assert race_kernel.race_winners(values[:0], keys[:0], sampling.MIXERS).shape == (0, 1)
    assert race_kernel.race_fits(values.to(DEVICE)) == CUDA
    assert not race_kernel.race_fits(values.to(DEVICE).t())


@pytest.mark.gpu
def test_a_gpu_races_in_the_kernel_unless_the_debug_knob_says_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from outrider.plugins import race_kernel, sampling

    calls: list[int] = []
    winners = race_kernel.race_winners

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return winners(*args)

    monkeypatch.setattr(race_kernel, "race_winners", counted)
    values = torch.randn(3, 3000, device="cuda")
    rows = torch.arange(3, device="cuda")
    keys = sampling._row_keys(rows, rows, 0)
    kernel = sampling._race(values, keys)
    assert calls == [1]
    monkeypatch.setenv("OUTRIDER_DEBUG_TORCH_KERNELS", "1")
    assert torch.equal(sampling._race(values, keys), kernel) and calls == [1]
