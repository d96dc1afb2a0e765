"""The FP8 fused MoE kernels (``plugins/models/fp8/moe_kernels.py``) against the reference
arithmetic (``fp8.reference.w8a8_moe``). Without a GPU the kernels run in Triton's interpreter,
which rounds some float32 -> e4m3 casts wrong: there the GEMMs and GEMVs take the reference's
quantized activations (x, then the intermediate); the whole layer, which quantizes, and a realistic
shape need a GPU."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fp8_fixtures import random_fp8_experts
from specialization import CLASS_TOKENS, classes_by_tokens

from outrider.plugins.models.fp8.reference import (
    Fp8Activations,
    Fp8ExpertWeights,
    dequantize,
    quantize_activations,
    quantize_weight,
    w8a8_moe,
)
from outrider.plugins.models.moe.tiles import GemmTiles, GemvTiles, MoeKernelConfig

CUDA = torch.cuda.is_available()  # without one, conftest.py runs Triton's interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'outrider[triton]')",
)

# 6 experts, H = 80 (two groups of 32 and a partial third), I = 48 (three blocks of 16 rows,
# a group of 32 and a partial one): every mask is exercised.
EXPERTS, HIDDEN, INTER, TOPK, BLOCK = 6, 80, 48, 2, (16, 32)
SMALL_CONFIG = MoeKernelConfig(
    16,
    GemmTiles(block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2),
    GemmTiles(block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=2),
)
SMALL_DECODE = GemvTiles(block_n=16, block_k=32, num_warps=4, num_stages=2)
# Several groups a GEMV step (4 of 32 columns over HIDDEN's 80, 2 over INTER's 48): the last
# step's groups partly or wholly past the row.
WIDE_DECODE = GemvTiles(block_n=16, block_k=128, num_warps=4, num_stages=2)


def _routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    weights, ids = torch.topk(logits.softmax(-1), topk)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def _dequantized(acts: Fp8Activations, group: int) -> torch.Tensor:
    scale = acts.scale.repeat_interleave(group, dim=1)[:, : acts.data.shape[1]]
    return acts.data.double() * scale.double()


def _gate_up_reference(
    acts: Fp8Activations, experts: Fp8ExpertWeights, ids: torch.Tensor
) -> torch.Tensor:
    """``[T*k, I]`` float32: each pair's SiLU-and-multiply from the quantized activations."""
    x = _dequantized(acts, experts.block[1])
    rows = []
    for pair, expert in enumerate(ids.flatten().tolist()):
        w13 = dequantize(experts.gate_up(expert)).double()
        gate, up = (x[pair // ids.shape[1]] @ w13.T).float().chunk(2)
        rows.append(F.silu(gate) * up)
    return torch.stack(rows)


def _down_reference(
    h_acts: Fp8Activations, experts: Fp8ExpertWeights, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``[T, H]`` float32: each token's weighted down products, summed over its slots."""
    h = _dequantized(h_acts, experts.block[1])
    out = torch.zeros(ids.shape[0], experts.w2.shape[1], dtype=torch.float64, device=h.device)
    for pair, expert in enumerate(ids.flatten().tolist()):
        token, slot = divmod(pair, ids.shape[1])
        w2 = dequantize(experts.down(expert)).double()
        out[token] += weights[token, slot].double() * (h[pair] @ w2.T)
    return out.float()


def _float32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Float32 sums in another order: each output within a few ulps of the largest (its
    terms are as large: sums of products of order one cancel)."""
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_gemms_and_gemvs_from_the_references_activations(tokens: int) -> None:
    """Both paths' gate/up (with SiLU-and-multiply) from the reference's quantized x, and
    their down (weighted, summed per token) from the reference's quantized intermediate."""
    from outrider.plugins.models.fp8 import moe_kernels as mk
    from outrider.plugins.models.moe.align import align_pairs
    from outrider.plugins.models.moe.kernels import _SUM_BLOCK, _sum_slots_kernel

    experts = random_fp8_experts(EXPERTS, HIDDEN, INTER, BLOCK, DEVICE)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator(device=DEVICE).manual_seed(1),
                    device=DEVICE) * 3  # fmt: skip
    weights, ids = _routing(tokens, EXPERTS, TOPK, seed=2)
    acts = quantize_activations(x, BLOCK[1])
    h_ref = _gate_up_reference(acts, experts, ids)
    aligned = align_pairs(ids, EXPERTS, SMALL_CONFIG.block_m)
    h_gemm = mk.gate_up_gemm(acts, experts, aligned, SMALL_CONFIG, torch.float32)
    _float32_close(h_gemm, h_ref)
    for tiles in (SMALL_DECODE, WIDE_DECODE):
        _float32_close(mk.gate_up_gemv(acts, experts, ids, torch.float32, tiles), h_ref)
    h_acts = quantize_activations(h_ref, BLOCK[1])
    out_ref = _down_reference(h_acts, experts, ids, weights)
    parts = mk.down_gemm(h_acts, experts, weights, aligned, SMALL_CONFIG)
    out_gemm = torch.empty_like(x)
    _sum_slots_kernel[(tokens, 1)](
        parts, out_gemm, HIDDEN, parts.stride(0), out_gemm.stride(0), TOPK=TOPK, BLOCK=_SUM_BLOCK,
        PDL=False,
    )  # fmt: skip
    _float32_close(out_gemm, out_ref)
    for tiles in (SMALL_DECODE, WIDE_DECODE):
        out_gemv = mk.down_gemv(h_acts, experts, ids, weights, torch.empty_like(x), tiles)
        _float32_close(out_gemv, out_ref)


@pytest.mark.skipif(CUDA, reason="reads the launches of Triton's interpreter")
def test_every_batch_size_runs_the_kernels_the_first_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grouped FP8 path and the block-scaled GEMM (an FP8 model's prompt projections) at
    token counts whose tokens, pairs and row blocks fall in each of Triton's classes (1, a
    multiple of 16, neither): each kernel launches with the same classes, so a batch of a new
    size never compiles while serving."""
    from outrider.plugins.models.fp8 import moe_kernels as mk
    from outrider.plugins.models.fp8.kernels import scaled_block_gemm

    experts = random_fp8_experts(EXPERTS, HIDDEN, INTER, BLOCK, DEVICE)
    weight = quantize_weight(torch.randn(INTER, HIDDEN), BLOCK)

    def run_at(tokens: int) -> Callable[[], object]:
        x = torch.randn(tokens, HIDDEN)
        weights, ids = _routing(tokens, EXPERTS, TOPK, seed=tokens)
        acts = quantize_activations(x, BLOCK[1])

        def run() -> None:
            mk.grouped_moe_fp8(x, experts, weights, ids, SMALL_CONFIG, torch.empty_like(x))
            scaled_block_gemm(acts, weight, None, x.dtype)

        return run

    found = classes_by_tokens(monkeypatch, run_at, CLASS_TOKENS)
    assert {"_gate_up_kernel", "_down_kernel", "_block_gemm_kernel"} <= set(found[1])
    assert found == dict.fromkeys(CLASS_TOKENS, found[1])


def test_blocks_the_kernels_cannot_take_run_the_reference() -> None:
    """Groups of 24 (no power of two): the reference arithmetic, exactly."""
    from outrider.plugins.models.fp8 import moe_kernels as mk

    experts = random_fp8_experts(4, 48, 48, (24, 24), DEVICE)
    assert not mk.kernels_serve(experts)
    x = torch.randn(3, 48, generator=torch.Generator(device=DEVICE).manual_seed(3), device=DEVICE)
    weights, ids = _routing(3, 4, TOPK, seed=4)
    got = mk.fused_moe_fp8(x, experts, weights, ids)
    assert torch.equal(got, w8a8_moe(x, experts, weights, ids, every_expert=False))


def _within(got: torch.Tensor, ref: torch.Tensor) -> None:
    """A float32 sum in another order can land one e4m3 input of the down product on the
    other side of a rounding boundary (1/16 of itself), and the FP8 tensor cores' shorter
    sums move more of them: 4 % of the output's largest value bounds those (2.6 % seen on an
    H200); a wrong scale or block is off by far more."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert (got.float() - ref.float()).abs().max() <= 0.04 * ref.float().abs().max()


@pytest.mark.gpu  # the layer quantizes: see the module docstring
@pytest.mark.parametrize("tokens", [1, 4, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_is_the_reference_on_a_gpu(tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's expert shape at one rank of two (384 rows: three blocks of 128):
    the decode path (1, 4 tokens at k = 8) and the grouped one (64, 300) against
    ``w8a8_moe``, in float32 and bfloat16; a CUDA graph replays the decode path."""
    from outrider.plugins.models.fp8 import moe_kernels as mk

    experts = random_fp8_experts(128, 2048, 384, (128, 128), DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(tokens, 2048, generator=gen, device=DEVICE).to(dtype)
    weights, ids = _routing(tokens, 128, 8, seed=6)
    ref = w8a8_moe(x, experts, weights, ids, every_expert=False)
    _within(mk.fused_moe_fp8(x, experts, weights, ids), ref)
    if tokens == 1:
        graph = torch.cuda.CUDAGraph()
        mk.fused_moe_fp8(x, experts, weights, ids)  # compiled before capture
        with torch.cuda.graph(graph):
            captured = mk.fused_moe_fp8(x, experts, weights, ids)
        graph.replay()
        _within(captured, ref)


@pytest.mark.gpu
def test_fp8_moe_model_on_the_gpu_kernels(tmp_path: Path) -> None:
    """A dummy FP8 Qwen3-MoE in bf16 on the GPU (128 x 128 blocks, 256 expert rows): a
    sparse layer's block on nine tokens (grouped path) and on one (decode path) through these
    kernels against the reference kernels', within ``_within``'s bound."""
    from fp8_fixtures import block_config
    from model_fixtures import TINY

    from outrider.plugins.models.kernels import TORCH_KERNELS, TorchKernels, use_kernels
    from outrider.plugins.models.loader import load_model

    class MoeFp8OnGpu(TorchKernels):
        def fused_moe_fp8(
            self,
            x: torch.Tensor,
            experts: Fp8ExpertWeights,
            topk_weights: torch.Tensor,
            topk_ids: torch.Tensor,
        ) -> torch.Tensor:
            from outrider.plugins.models.fp8 import moe_kernels as moe_fp8_kernels

            return moe_fp8_kernels.fused_moe_fp8(x, experts, topk_weights, topk_ids)

    shape = TINY | {"hidden_size": 512, "head_dim": 128, "num_hidden_layers": 2}
    shape |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
    config = shape | {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": block_config((128, 128))})
    )
    model, _ = load_model(
        tmp_path, dtype=torch.bfloat16, device="cuda", load_format="dummy", max_positions=64
    )
    block = model.model.layers[1].mlp
    hidden = torch.randn(9, 512, generator=torch.Generator(device="cuda").manual_seed(0),
                         device="cuda").bfloat16()  # fmt: skip
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, kernels in (("gpu", MoeFp8OnGpu()), ("reference", TORCH_KERNELS)):
        use_kernels(model, kernels)
        with torch.no_grad():
            outputs[name] = [block(hidden), block(hidden[:1])]
    for got, ref in zip(outputs["gpu"], outputs["reference"], strict=True):
        _within(got, ref)
