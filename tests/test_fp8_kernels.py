"""The GPU paths of FP8 projections (``plugins/models/fp8_kernels.py``) against the reference
arithmetic (``fp8.py``): activation quantization bit for bit, the block-scaled GEMV and GEMM
to float32 accumulation order. Without a GPU the Triton kernels run in Triton's interpreter
on CPU tensors, which rounds some float32 -> e4m3 casts wrong: there the kernels that quantize
see activations that need no rounding, the GEMM the reference's quantized ones; rounding,
``torch._scaled_mm`` and an FP8 model's projections on these kernels need a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from outrider.plugins.models.fp8 import (
    FP8,
    Fp8Weight,
    quantize_activations,
    quantize_weight,
    w8a8_linear,
)
from outrider.plugins.models.kernels import TorchKernels

CUDA = torch.cuda.is_available()  # without one, conftest.py runs Triton's interpreter
DEVICE = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Triton is not installed (pip install 'outrider[triton]')",
)


def _gen() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(0)


@pytest.mark.gpu  # the interpreter rounds some e4m3 casts wrong (fp8_kernels.py)
@pytest.mark.parametrize("group", [32, 96])
def test_activation_quantization_is_the_references(group: int) -> None:
    """Values and scales equal to the bit: groups past the row's end, a row of zeros, a
    group (96, per channel) that is no power of two, values past e4m3's range."""
    from outrider.plugins.models import fp8_kernels

    x = torch.randn(4, 96, generator=_gen(), device=DEVICE) * 5
    x[2] = 0.0
    x[3, :40] = 1e4
    got = fp8_kernels.quantize_activations(x, group)
    ref = quantize_activations(x, group)
    assert got.data.dtype == FP8
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scale, ref.scale)


# (rows, columns, block): rows past a GEMM tile and a partial last row block (40 rows in
# blocks of 32); a partial last K group (80 columns in groups of 32) and whole ones.
SHAPES = [(48, 64, (16, 32)), (40, 80, (32, 32)), (136, 64, (32, 16))]


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
def test_block_gemm_is_the_reference_product(n: int, k: int, block: tuple[int, int]) -> None:
    """The GEMM from the reference's quantized activations, with and without a bias."""
    from outrider.plugins.models import fp8_kernels

    gen = _gen()
    weight = quantize_weight(torch.randn(n, k, generator=gen, device=DEVICE), block)
    x = torch.randn(70, k, generator=gen, device=DEVICE)
    bias = torch.randn(n, generator=gen, device=DEVICE)
    acts = quantize_activations(x, block[1])
    for b in (bias, None):
        got = fp8_kernels.scaled_block_gemm(acts, weight, b, x.dtype)
        torch.testing.assert_close(got, w8a8_linear(x, weight, b), atol=1e-4, rtol=1e-5)


def _representable(tokens: int, k: int, group: int) -> torch.Tensor:
    """``[tokens, k]`` activations that quantize without rounding: e4m3 values times a power
    of two per group, each group's largest 448 of them (its scale that power of two)."""
    gen = _gen()
    values = torch.randn(tokens, k, generator=gen, device=DEVICE).clamp(-400, 400)
    values = (values * 64).to(FP8).float()
    values[:, ::group] = 448.0
    powers = 2.0 ** torch.randint(-3, 4, (tokens, -(-k // group)), generator=gen, device=DEVICE)
    return values * powers.repeat_interleave(group, dim=1)[:, :k]


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_quantizing_kernels_on_representable_activations(
    n: int, k: int, block: tuple[int, int], tokens: int
) -> None:
    """Where no value rounds (so the interpreter's casts are exact too): the quantization
    kernel's values and scales, the GEMV (one token) and quantization with the GEMM (five)
    against the reference."""
    from outrider.plugins.models import fp8_kernels

    x = _representable(tokens, k, block[1])
    acts, ref = fp8_kernels.quantize_activations(x, block[1]), quantize_activations(x, block[1])
    assert torch.equal(acts.data.float(), ref.data.float())
    assert torch.equal(acts.scale, ref.scale)
    weight = quantize_weight(torch.randn(n, k, generator=_gen(), device=DEVICE), block)
    bias = torch.randn(n, generator=_gen(), device=DEVICE)
    got = fp8_kernels.fp8_linear(x, weight, bias)
    torch.testing.assert_close(got, w8a8_linear(x, weight, bias), atol=1e-3, rtol=1e-5)


@pytest.mark.gpu  # they quantize: see above
@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_block_kernels_are_the_reference_product(
    n: int, k: int, block: tuple[int, int], tokens: int
) -> None:
    """One token through the GEMV, five through quantization and the GEMM, float32 and
    bfloat16 (a bf16 step apart at most: both round once from float32)."""
    from outrider.plugins.models import fp8_kernels

    gen = _gen()
    weight = quantize_weight(torch.randn(n, k, generator=gen, device=DEVICE), block)
    x = torch.randn(tokens, k, generator=gen, device=DEVICE)
    bias = torch.randn(n, generator=gen, device=DEVICE)
    got = fp8_kernels.fp8_linear(x, weight, bias)
    torch.testing.assert_close(got, w8a8_linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    got = fp8_kernels.fp8_linear(x.bfloat16(), weight, bias.bfloat16())
    ref = w8a8_linear(x.bfloat16(), weight, bias.bfloat16())
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_scaled_mm_is_the_reference_product(tokens: int) -> None:
    """Per-channel weights through ``torch._scaled_mm`` (bf16 out) against the reference."""
    from outrider.plugins.models import fp8_kernels

    gen = _gen()
    weight = quantize_weight(torch.randn(256, 512, generator=gen, device=DEVICE), None)
    x = torch.randn(tokens, 512, generator=gen, device=DEVICE).bfloat16()
    bias = torch.randn(256, generator=gen, device=DEVICE).bfloat16()
    got = fp8_kernels.fp8_linear(x, weight, bias)
    ref = w8a8_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    # Both round once to bf16 from float32 sums in different orders: a bf16 step at most.
    torch.testing.assert_close(got.float(), ref.float(), atol=0.0, rtol=2**-7)


class _Fp8OnGpu(TorchKernels):
    """The reference kernels but for the FP8 projections, which run ``fp8_kernels``'."""

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        from outrider.plugins.models import fp8_kernels

        return fp8_kernels.fp8_linear(x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_model_on_the_gpu_kernels(tmp_path: Path, block: tuple[int, int] | None) -> None:
    """A dummy FP8 model in bf16 on the GPU (128-row heads and blocks): its fused q/k/v, o
    and MLP projections of nine tokens and of one on the GPU kernels against the reference
    kernels'. Each rounds to bf16 where the other does, but a bf16 step in the MLP's middle
    can move one of down_proj's e4m3 inputs by a step (1/16 of itself): 2 % of the output's
    largest value bounds a few of those, while a wrong scale or block is off by far more."""
    from fp8_fixtures import block_config, channel_config
    from model_fixtures import TINY

    from outrider.plugins.models.kernels import TORCH_KERNELS, use_kernels
    from outrider.plugins.models.loader import load_model

    shape = TINY | {"hidden_size": 512, "intermediate_size": 1024, "head_dim": 128}
    quantization = channel_config() if block is None else block_config(block)
    config = shape | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(
        json.dumps(config | {"quantization_config": quantization})
    )
    model, _ = load_model(
        tmp_path, dtype=torch.bfloat16, device="cuda", load_format="dummy", max_positions=64
    )
    layer = model.model.layers[0]
    hidden = torch.randn(9, 512, generator=_gen(), device="cuda").bfloat16()
    outputs: dict[str, list[torch.Tensor]] = {}
    for name, kernels in (("gpu", _Fp8OnGpu()), ("reference", TORCH_KERNELS)):
        use_kernels(model, kernels)
        with torch.no_grad():
            outputs[name] = [
                f(x)
                for f in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp)
                for x in (hidden, hidden[:1])
            ]
    for got, ref in zip(outputs["gpu"], outputs["reference"], strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()
