"""The GPU paths of FP8 projections (``plugins/models/fp8/kernels.py``) against the reference
arithmetic (``fp8/reference.py``): activation quantization bit for bit, the block-scaled GEMV and
GEMM to float32 accumulation order. Without a GPU the Triton kernels run in Triton's interpreter on
CPU tensors, which rounds some float32 -> e4m3 casts wrong: there the kernels that quantize see
activations that need no rounding, the GEMM the reference's quantized ones; rounding,
``torch._scaled_mm`` and an FP8 model's projections on these kernels need a GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from fp8_fixtures import exact_operand, product_magnitudes

from outrider.plugins.models.fp8.reference import (
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


@pytest.mark.gpu  # the interpreter rounds some e4m3 casts wrong (fp8/kernels.py)
@pytest.mark.parametrize("group", [32, 96])
def test_activation_quantization_is_the_references(group: int) -> None:
    """Values and scales equal to the bit: groups past the row's end, a row of zeros, a
    group (96, per channel) that is no power of two, values past e4m3's range."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    x = torch.randn(4, 96, generator=_gen(), device=DEVICE) * 5
    x[2] = 0.0
    x[3, :40] = 1e4
    got = fp8_kernels.quantize_activations(x, group)
    ref = quantize_activations(x, group)
    assert got.data.dtype == FP8
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scale, ref.scale)


# (rows, columns, block): rows past a GEMM tile (136 past 128) and partial last row blocks
# (40 rows in blocks of 32, 136 in blocks of 64); a partial last K group (80 columns in groups
# of 32) and whole ones.
SHAPES = [(48, 64, (16, 32)), (40, 80, (32, 32)), (136, 64, (64, 32))]
# A GEMM's FP8 tensor-core sums keep fewer bits than float32 within a group (Hopper: about
# 14): bounded by this share of the output's sum of product magnitudes.
ACCUMULATION = 2**-9


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
def test_block_gemm_is_the_reference_product(n: int, k: int, block: tuple[int, int]) -> None:
    """The GEMM from the reference's quantized activations, with and without a bias: equal
    to the bit on exact operands (``exact_operand``)."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    gen = _gen()
    weight = quantize_weight(exact_operand(n, k, block, gen), block)
    x = exact_operand(70, k, (1, block[1]), gen)
    acts = quantize_activations(x, block[1])
    for b in (_exact_bias(n, gen), None):
        got = fp8_kernels.scaled_block_gemm(acts, weight, b, x.dtype)
        assert torch.equal(got, w8a8_linear(x, weight, b))


def _exact_bias(n: int, gen: torch.Generator) -> torch.Tensor:
    """Halves from -4 to 4: added to an exact sum without rounding."""
    return torch.randint(-8, 9, (n,), generator=gen, device=DEVICE) / 2


@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_quantizing_kernels_on_representable_activations(
    n: int, k: int, block: tuple[int, int], tokens: int
) -> None:
    """Exact operands, where no value rounds (so the interpreter's casts are exact too): the
    quantization kernel's values and scales, the GEMV (one token) and quantization with the
    GEMM (five), all equal to the reference's to the bit."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    gen = _gen()
    x = exact_operand(tokens, k, (1, block[1]), gen)
    acts, ref = fp8_kernels.quantize_activations(x, block[1]), quantize_activations(x, block[1])
    assert torch.equal(acts.data.float(), ref.data.float())
    assert torch.equal(acts.scale, ref.scale)
    weight = quantize_weight(exact_operand(n, k, block, gen), block)
    bias = _exact_bias(n, gen)
    assert torch.equal(fp8_kernels.fp8_linear(x, weight, bias), w8a8_linear(x, weight, bias))


@pytest.mark.parametrize("k", [80, 4096])
def test_channel_gemv_on_representable_activations(k: int) -> None:
    """One token against per-channel weights (the decode step's projection): quantization of
    the whole row and the GEMV, equal to the reference to the bit on exact operands; 44
    rows end inside a program's block, 80 columns inside a step, 4,096 span steps."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    gen = _gen()
    x = exact_operand(1, k, (1, k), gen)
    weight = quantize_weight(exact_operand(44, k, (1, k), gen), None)
    bias = _exact_bias(44, gen)
    for b in (bias, None):
        assert torch.equal(fp8_kernels.fp8_linear(x, weight, b), w8a8_linear(x, weight, b))


@pytest.mark.gpu  # they quantize: see above
@pytest.mark.parametrize(("n", "k", "block"), SHAPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_block_kernels_are_the_reference_product(
    n: int, k: int, block: tuple[int, int], tokens: int
) -> None:
    """Random operands, which round: one token through the GEMV, five through quantization
    and the GEMM, float32 and bfloat16 (both round once from float32: a bf16 step apart at
    most, beyond the accumulation's share)."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    gen = _gen()
    weight = quantize_weight(torch.randn(n, k, generator=gen, device=DEVICE), block)
    x = torch.randn(tokens, k, generator=gen, device=DEVICE)
    bias = torch.randn(n, generator=gen, device=DEVICE)
    bound = ACCUMULATION * product_magnitudes(x, weight)
    got = fp8_kernels.fp8_linear(x, weight, bias)
    assert ((got - w8a8_linear(x, weight, bias)).abs() <= bound).all()
    got = fp8_kernels.fp8_linear(x.bfloat16(), weight, bias.bfloat16())
    ref = w8a8_linear(x.bfloat16(), weight, bias.bfloat16()).float()
    assert ((got.float() - ref).abs() <= bound + 2**-8 * ref.abs()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_scaled_mm_is_the_reference_product(tokens: int) -> None:
    """Per-channel weights through ``torch._scaled_mm`` (bf16 out) on exact operands: the
    reference's result to the bit (the same exact sum plus bias, rounded once to bf16)."""
    from outrider.plugins.models.fp8 import kernels as fp8_kernels

    gen = _gen()
    weight = quantize_weight(exact_operand(256, 512, (1, 512), gen), None)
    x = exact_operand(tokens, 512, (1, 512), gen).bfloat16()
    bias = _exact_bias(256, gen).bfloat16()
    got = fp8_kernels.fp8_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, w8a8_linear(x, weight, bias))


class _Fp8OnGpu(TorchKernels):
    """The reference kernels but for the FP8 projections, which run ``fp8/kernels.py``'s."""

    def fp8_linear(
        self, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        from outrider.plugins.models.fp8 import kernels as fp8_kernels

        return fp8_kernels.fp8_linear(x, weight, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
def test_fp8_model_on_the_gpu_kernels(tmp_path: Path, block: tuple[int, int] | None) -> None:
    """A dummy FP8 model in bf16 on the GPU (128-row heads and blocks): its fused q/k/v, o
    and MLP projections of nine tokens and of one on the GPU kernels against the reference
    kernels'. Each rounds to bf16 where the other does, but a bf16 step in the MLP's middle
    can move one of down_proj's e4m3 inputs by a step (1/16 of itself), and the tensor cores'
    shorter sums (``ACCUMULATION``) move more of them: 4 % of the output's largest value
    bounds those (2.1 % seen on an H200), while a wrong scale or block is off by far more."""
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
        assert (got.float() - ref.float()).abs().max() <= 0.04 * ref.float().abs().max()
