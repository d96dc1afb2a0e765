"""Models, loader, config parsing and the torch attention backend against HF transformers."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch
from conftest import CONFIGS
from model_fixtures import VOCAB, PagedRows, llama3_rope, save_tiny_model, torch_backend
from safetensors.torch import load_file, save_file

from outrider.plugins.api import PHASES, CheckContext, Phase, Problem
from outrider.plugins.attention.torch_impl import TorchAttentionMetadata
from outrider.plugins.checks import attention_problems
from outrider.plugins.device import AttentionShape, ForwardBatch, KVCache
from outrider.plugins.models.config import (
    ModelConfig,
    config_is_complete,
    load_eos_ids,
)
from outrider.plugins.models.layers import DecoderForCausalLM
from outrider.plugins.models.loader import (
    check_checkpoint_layout,
    expected_checkpoint_shapes,
    load_model,
)
from outrider.plugins.models.registry import model_class
from outrider.plugins.models.rope import rope_inv_freq
from outrider.plugins.models.rope_config import RopeConfig
from outrider.plugins.registry import named_spec

KINDS = ("llama", "qwen2", "qwen3")
PROMPT_LENS = (5, 12, 19)
SLOTS = (3, 0, 5)
DECODE_STEPS = 3
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


Checkpoints = dict[str, tuple[Path, torch.nn.Module]]  # kind -> (directory, HF reference)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    out = {}
    for kind in KINDS:
        directory = tmp_path_factory.mktemp(kind)
        # Llama is saved in several shards (its embedding alone is 77 KB).
        shard = "60KB" if kind == "llama" else "1GB"
        out[kind] = (directory, save_tiny_model(kind, directory, max_shard_size=shard))
    return out


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _load(path: Path, load_format: Literal["auto", "dummy"] = "auto") -> DecoderForCausalLM:
    model, _ = load_model(
        path,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        max_positions=64,
        progress=_quiet,
    )
    return model


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    total = [n + DECODE_STEPS for n in PROMPT_LENS]
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in total]


def _run(
    model: DecoderForCausalLM,
    rows: PagedRows,
    batch: list[tuple[int, list[int]]],
    kv_slack: int = 0,
    capture_layers: tuple[int, ...] = (),
) -> tuple[tuple[torch.Tensor, ...], ForwardBatch]:
    """One step through ``model``: per-row logits ``[len, vocab]`` and the batch."""
    backend = torch_backend(model.attention_shape)
    input_ids, fb = rows.batch(backend, batch, kv_slack=kv_slack, capture_layers=capture_layers)
    with torch.no_grad():
        logits = model.compute_logits(model(input_ids, fb))
    return logits.split([len(tokens) for _, tokens in batch]), fb


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunked"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf(
    checkpoints: Checkpoints, kind: str, chunked: bool, page_size: int
) -> None:
    directory, hf = checkpoints[kind]
    model = _load(directory)
    seqs = _sequences()
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]  # [len, vocab] each
    rows = PagedRows(
        num_layers=model.num_layers,
        shape=model.attention_shape,
        page_size=page_size,
        max_len=max(map(len, seqs)),
    )
    prefill = [[(0, n // 2), (n // 2, n)] if chunked else [(0, n)] for n in PROMPT_LENS]
    steps = list(zip(*prefill, strict=True))
    steps += [tuple((n + i, n + i + 1) for n in PROMPT_LENS) for i in range(DECODE_STEPS)]
    for step, spans in enumerate(steps):
        batch = [(slot, seq[a:b]) for slot, seq, (a, b) in zip(SLOTS, seqs, spans, strict=True)]
        # Decode steps take a loose max_kv bound, past the page table's width.
        got, _ = _run(model, rows, batch, kv_slack=20 if step >= len(steps) - DECODE_STEPS else 0)
        for (a, b), seq_logits, ref in zip(spans, got, expected, strict=True):
            torch.testing.assert_close(seq_logits, ref[a:b], atol=ATOL, rtol=0)


def test_captured_hidden_states(checkpoints: Checkpoints) -> None:
    directory, hf = checkpoints["llama"]
    model = _load(directory)
    seq = _sequences()[0]
    rows = PagedRows(
        num_layers=model.num_layers, shape=model.attention_shape, page_size=4, max_len=len(seq)
    )
    _, fb = _run(model, rows, [(0, seq)], capture_layers=(0, 1))
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
    assert sorted(fb.captured) == [0, 1]
    for layer in (0, 1):  # hidden_states[L + 1] is the output of layer L
        torch.testing.assert_close(fb.captured[layer], ref[layer + 1][0], atol=ATOL, rtol=0)


def test_non_causal_attention_matches_dense() -> None:
    torch.manual_seed(0)
    lens, page_size, hq, hkv, dim = (3, 7), 4, 4, 2, 8
    shape = AttentionShape(hq, hkv, dim, dim**-0.5, torch.float32)
    rows = PagedRows(num_layers=1, shape=shape, page_size=page_size, max_len=max(lens))
    backend = torch_backend(shape)
    batch = [(slot, [0] * n) for slot, n in zip((1, 2), lens, strict=True)]
    _, fb = rows.batch(backend, batch, causal=False, kv_slack=5)
    q, k, v = torch.randn(10, hq, dim), torch.randn(10, hkv, dim), torch.randn(10, hkv, dim)
    assert isinstance(fb.metadata, TorchAttentionMetadata)
    assert fb.metadata.mask.any(dim=-1).all()  # padded query cells see kv 0: no NaN
    out = backend.forward(0, q, k, v, fb)
    for start, n in ((0, 3), (3, 7)):
        rq, rk, rv = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(rq, rk, rv, enable_gqa=True)
        torch.testing.assert_close(out[start : start + n], ref.transpose(0, 1))


def _dense_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One row's attention as transformers' eager gpt-oss writes it: queries at positions
    ``first ..`` over keys ``0 ..`` (``[n, H, D]`` each, K/V heads repeated), causal, within
    ``window`` positions back (0: all), each head's softmax taking its sink logit."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    q_pos = torch.arange(first, first + q.shape[0]).view(-1, 1)
    k_pos = torch.arange(k.shape[0]).view(1, -1)
    allowed = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class WindowPages:
    """A window page space for ``PagedRows`` (``KVCache.window_map``): before each batch, the
    pages its rows' windows read and write get window pages, and those wholly behind every
    window of their slot go back, their map entry the scratch page."""

    def __init__(self, rows: PagedRows, window: int, pages: int) -> None:
        self.rows, self.window = rows, window
        self.free = list(range(pages - 1, 0, -1))
        self.held: dict[int, int] = {}  # page -> its window page
        self.most = 0

    def before(self, spans: dict[int, tuple[int, int]]) -> None:
        """Window pages for a batch of ``spans`` (slot -> its positions ``start, end``)."""
        map_ = self.rows.kv.window_map
        assert map_ is not None
        page_size = self.rows.page_size
        for slot, pages in self.rows.pages.items():  # a slot's next query: at its length
            first = self.rows.lengths[slot] - self.window + 1  # the first position it reads
            for index, page in enumerate(pages):
                if (index + 1) * page_size <= first and page in self.held:
                    self.free.append(self.held.pop(page))
                    map_[page] = 0
        for slot, (start, end) in spans.items():
            self.rows.grow(slot, end)
            for index, page in enumerate(self.rows.pages[slot]):
                if (index + 1) * page_size > start - self.window + 1 and page not in self.held:
                    self.held[page] = self.free.pop()
                    map_[page] = self.held[page]
        self.most = max(self.most, len(self.held))


@pytest.mark.parametrize("storage", ["whole", "window pages"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_sliding_windows_and_sinks_match_dense(sinks: bool, storage: str) -> None:
    """The torch backend's layers of a shape with a sliding window (layer 1: 3 positions) and
    sinks: prompts (one of them in two chunks), then a decode step, each query within its
    layer's window, the sinks in its heads' softmax, against the dense eager reference. With
    the window layer in window pages, those behind every window given back before each step:
    the same outputs from fewer pages."""
    torch.manual_seed(0)
    hq, hkv, dim, page_size = 4, 2, 8, 4
    shape = AttentionShape(hq, hkv, dim, dim**-0.5, torch.float32, windows=(0, 3), sinks=sinks)
    rows = PagedRows(num_layers=2, shape=shape, page_size=page_size, max_len=16)
    pages = None
    if storage == "window pages":
        full = rows.kv.num_pages
        rows.kv = KVCache.allocate(2, full, page_size, shape, torch.float32, rows.device, 5)
        assert [tuple(t.shape[:1]) for t in rows.kv.k] == [(full,), (5,)]
        pages = WindowPages(rows, 3, 5)
    backend = torch_backend(shape)
    sink_logits = torch.randn(hq) if sinks else None
    lens = {1: 9, 2: 6}
    steps = [{1: (0, 5), 2: (0, 6)}, {1: (5, 9)}, {1: (9, 10), 2: (6, 7)}]
    every: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    for slot in lens:
        for layer in (0, 1):
            every[slot, layer] = tuple(torch.randn(10, h, dim) for h in (hq, hkv, hkv))
    for spans in steps:
        if pages is not None:
            pages.before(spans)
        batch = [(slot, [0] * (b - a)) for slot, (a, b) in spans.items()]
        _, fb = rows.batch(backend, batch, kv_slack=3)
        for layer in (0, 1):
            q, k, v = (
                torch.cat([every[slot, layer][i][a:b] for slot, (a, b) in spans.items()])
                for i in range(3)
            )
            out = fb.attend(layer, q, k, v, sink_logits)
            start = 0
            for slot, (a, b) in spans.items():
                rq, rk, rv = every[slot, layer]
                repeat = hq // hkv
                ref = _dense_with_sinks(
                    rq[a:b], rk[:b].repeat_interleave(repeat, 1),
                    rv[:b].repeat_interleave(repeat, 1), a, shape.window(layer), sink_logits,
                )  # fmt: skip
                torch.testing.assert_close(out[start : start + b - a], ref)
                start += b - a
    if pages is not None:  # five pages hold the two rows; at most four had window pages
        assert (rows.next_page - 1, pages.most) == (5, 4)


def test_backends_without_windows_or_sinks_refuse_such_shapes() -> None:
    """A backend that does not declare them refuses a shape holding them at once."""
    from outrider.plugins.api import NoOptions
    from outrider.plugins.attention.flashinfer_impl import FlashInferAttention

    for shape in (
        AttentionShape(4, 2, 64, 0.125, torch.bfloat16, windows=(0, 8)),
        AttentionShape(4, 2, 64, 0.125, torch.bfloat16, sinks=True),
    ):
        with pytest.raises(ValueError, match="FlashInferAttention serves no sliding windows or"):
            FlashInferAttention(shape, NoOptions(), torch.device("cpu"))


def test_auto_serves_windows_and_sinks_where_both_its_backends_do(tmp_path: Path) -> None:
    """``auto`` declares windows and sinks and checks each of its backends against the model:
    with triton on both sides it takes gpt-oss's decode phases; a backend it cannot route
    (flashinfer plans on the host) is refused, named."""
    config = {"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    routes: dict[Phase, str] = {phase: "auto" for phase in PHASES} | {"extend": "triton"}

    def problems(options: str) -> list[Problem]:
        ctx = CheckContext(
            device="cuda", dtype="bfloat16", page_size=16, overlap=True, attention_routes=routes,
            speculative_algorithm="none", model=str(tmp_path), attention_config={"auto": options},
        )  # fmt: skip
        auto = named_spec("attention", "auto")
        assert auto.attention is not None and auto.attention.sliding_window and auto.attention.sinks
        return attention_problems(auto, auto.attention, ctx) + list(auto.check(auto, ctx))

    if importlib.util.find_spec("triton") is not None:
        assert problems('{"small": "triton", "large": "triton"}') == []
    refused = problems('{"small": "flashinfer", "large": "triton"}')
    assert [p.message for p in refused] == [
        "small: flashinfer cannot be routed by auto, which takes backends that read every length "
        "on the device (no host plans, one CUDA graph per batch size)"
    ]


def test_backends_without_windows_or_sinks_are_refused_for_a_model_with_them(
    tmp_path: Path,
) -> None:
    """The capability check names each thing a model's attention asks for that the backend
    routed to its phases lacks, with the flags that route it; torch and triton serve both."""
    config = {"model_type": "gpt_oss", "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    routes: dict[Phase, str] = {phase: "flashinfer" for phase in PHASES} | {"extend": "triton"}
    ctx = CheckContext(
        device="cuda", dtype="bfloat16", page_size=16, overlap=True, attention_routes=routes,
        speculative_algorithm="none", model=str(tmp_path),
    )  # fmt: skip
    option = (
        "--decode-attention-backend / --verify-attention-backend / --draft-attention-backend "
        "flashinfer"
    )
    lacking = named_spec("attention", "flashinfer")
    assert lacking.attention is not None
    assert attention_problems(lacking, lacking.attention, ctx) == [
        Problem(option, "flashinfer has no sliding-window layers (layer_types), which --model "
                f"{tmp_path} has"),
        Problem(option, f"flashinfer has no attention sinks (gpt_oss), which --model {tmp_path} "
                "has"),
    ]  # fmt: skip
    for serving in ("torch", "triton"):
        spec = named_spec("attention", serving)
        assert spec.attention is not None
        assert attention_problems(spec, spec.attention, ctx) == [], serving


def test_checkpoint_names_match_hf(checkpoints: Checkpoints) -> None:
    for kind in KINDS:
        directory = checkpoints[kind][0]
        config = ModelConfig.from_pretrained(directory)
        saved = {}
        for file in directory.glob("*.safetensors"):
            saved.update({k: tuple(v.shape) for k, v in load_file(file).items()})
        assert saved == expected_checkpoint_shapes(config), kind
    assert len(list(checkpoints["llama"][0].glob("*.safetensors"))) >= 2
    assert "lm_head.weight" not in expected_checkpoint_shapes(
        ModelConfig.from_pretrained(checkpoints["qwen3"][0])
    )


def test_loader_rejects_unexpected_and_missing(checkpoints: Checkpoints, tmp_path: Path) -> None:
    source = checkpoints["llama"][0]
    extra, missing = tmp_path / "extra", tmp_path / "missing"
    for directory, edit in ((extra, "add"), (missing, "drop")):
        shutil.copytree(source, directory)
        shard = sorted(directory.glob("*.safetensors"))[-1]
        tensors = load_file(shard)
        if edit == "add":
            tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
        else:
            tensors.pop("model.norm.weight")
        save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        _load(extra)
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight"):
        _load(missing)


def test_dummy_load_same_shapes(checkpoints: Checkpoints, tmp_path: Path) -> None:
    directory = checkpoints["qwen3"][0]
    # Only config.json, addressed by file: dummy needs no weights.
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    dummy = _load(tmp_path / "config.json", load_format="dummy")
    real = _load(directory)
    shapes = {name: p.shape for name, p in real.named_parameters()}
    assert {name: p.shape for name, p in dummy.named_parameters()} == shapes
    again = _load(tmp_path / "config.json", load_format="dummy")
    assert all(
        torch.equal(a, b) for a, b in zip(dummy.parameters(), again.parameters(), strict=True)
    )
    shape = dummy.attention_shape
    rows = PagedRows(num_layers=dummy.num_layers, shape=shape, page_size=4, max_len=8)
    logits, _ = _run(dummy, rows, [(0, list(range(8)))])
    assert torch.isfinite(logits[0]).all()


@pytest.mark.parametrize("name", ["Qwen3-8B", "Llama-3.1-8B-Instruct"])
def test_reference_configs_map_onto_parameters(name: str) -> None:
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.config.json")
    check_checkpoint_layout(config)
    assert config.head_dim == 128 and config.num_kv_heads == 8 and config.dtype == "bfloat16"
    if name == "Qwen3-8B":
        assert config.qk_norm and config.rope.theta == 1e6 and config.rope.llama3 is None
    else:
        assert config.eos_token_ids == (128001, 128008, 128009)
        assert config.rope.theta == 500000.0 and config.rope.llama3 is not None
        assert config.rope.llama3.factor == 8.0


@pytest.mark.parametrize(
    ("name", "layers", "experts"), [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)]
)
def test_gpt_oss_configs_map_onto_parameters(name: str, layers: int, experts: int) -> None:
    """The published gpt-oss shapes: sliding layers of 128 first and every other one, sinks,
    YaRN of factor 32 over 4,096 positions, mxfp4 experts, and the checkpoint's tensors
    mapping onto the model built on the meta device."""
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.config.json")
    check_checkpoint_layout(config)
    assert config.windows == (128, 0) * (layers // 2) and config.sinks and config.mxfp4_experts
    assert config.moe is not None and config.moe.clamped_swiglu is not None
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (
        experts, 4, 2880,
    )  # fmt: skip
    assert config.moe.clamped_swiglu.alpha == 1.702 and config.moe.clamped_swiglu.limit == 7.0
    assert config.rope.yarn is not None and config.rope.yarn.factor == 32.0
    assert (
        config.rope.yarn.original_max_position_embeddings == 4096 and not config.rope.yarn.truncate
    )
    assert (config.head_dim, config.num_q_heads, config.num_kv_heads) == (64, 64, 8)


def test_unsupported_architecture_and_rope(tmp_path: Path) -> None:
    draft = ModelConfig.from_pretrained(CONFIGS / "Qwen3-8B-DFlash-b16.config.json")
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        model_class(draft.architecture)
    raw = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        ModelConfig.from_pretrained(tmp_path)


YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0}
YARN_CASES = [
    YARN | {"original_max_position_embeddings": 256},
    YARN | {"original_max_position_embeddings": 256, "truncate": False, "beta_fast": 8},
    YARN | {"original_max_position_embeddings": 64, "attention_factor": 1.3},
    YARN | {"original_max_position_embeddings": 64, "mscale": 0.9, "mscale_all_dim": 0.5},
    YARN | {"original_max_position_embeddings": 8},  # every pair past the ramp
]


@pytest.mark.parametrize("rope", YARN_CASES)
def test_yarn_frequencies_and_scale_are_transformers(rope: dict[str, object]) -> None:
    """YaRN's frequencies and cos/sin scale, parsed from config.json, bit for bit those
    transformers computes (its rope functions, on a Llama config of head dim 16)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = {"hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 512}
    hf = transformers.LlamaConfig(**shape, rope_parameters=dict(rope))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    parsed = ModelConfig.from_dict(_llama_dict(shape, rope))
    assert parsed.rope.yarn is not None
    assert torch.equal(rope_inv_freq(16, parsed.rope), inv_freq)
    assert parsed.rope.attention_factor == factor
    assert not torch.equal(inv_freq, rope_inv_freq(16, RopeConfig(100.0)))  # YaRN moved them


def _llama_dict(shape: dict[str, int], rope: dict[str, object]) -> dict[str, object]:
    """A Llama config.json's keys for ``from_dict`` with ``shape`` and ``rope``."""
    tiny = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.config.json").read_text())
    return tiny | shape | {"rope_parameters": rope}


def test_yarn_logits_match_hf(tmp_path: Path) -> None:
    """A model under YaRN (scaled frequencies, cos and sin scaled) gives transformers' logits,
    prefill and decode."""
    rope = YARN_CASES[1]
    hf = save_tiny_model("qwen2", tmp_path, config_overrides={"rope_parameters": dict(rope)})
    model = _load(tmp_path)
    assert model.config.rope.yarn is not None and model.config.rope.attention_factor > 1
    seqs = _sequences()
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in seqs]
    rows = PagedRows(
        num_layers=model.num_layers, shape=model.attention_shape, page_size=4,
        max_len=max(map(len, seqs)),
    )  # fmt: skip
    steps = [tuple((0, n) for n in PROMPT_LENS)]
    steps += [tuple((n + i, n + i + 1) for n in PROMPT_LENS) for i in range(DECODE_STEPS)]
    for spans in steps:
        batch = [(slot, seq[a:b]) for slot, seq, (a, b) in zip(SLOTS, seqs, spans, strict=True)]
        got, _ = _run(model, rows, batch)
        for (a, b), seq_logits, ref in zip(spans, got, expected, strict=True):
            torch.testing.assert_close(seq_logits, ref[a:b], atol=ATOL, rtol=0)


def test_rope_v4_and_v5_keys_agree(tmp_path: Path) -> None:
    base = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "torch_dtype"):
        base.pop(key)
    rope = llama3_rope(theta=250000.0)
    v4 = {**base, "rope_theta": 250000.0, "torch_dtype": "bfloat16"}
    v4["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    v5 = {**base, "rope_parameters": rope, "dtype": "bfloat16"}
    parsed = []
    for name, raw in (("v4", v4), ("v5", v5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        parsed.append(ModelConfig.from_pretrained(tmp_path / name))
    assert parsed[0] == parsed[1]
    assert parsed[0].rope.theta == 250000.0 and parsed[0].rope.llama3 is not None
    assert parsed[0].rope.llama3.original_max_position_embeddings == 32


def _through_transformers(config: dict[str, object], directory: Path) -> ModelConfig:
    from transformers import AutoConfig

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dict(AutoConfig.from_pretrained(str(directory)).to_dict())


MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss")


def test_complete_configs_read_as_transformers_reads_them(tmp_path: Path) -> None:
    """Every reference target config and every family's tiny config is complete, and read
    without transformers gives what transformers' AutoConfig gives (a draft's config need not
    be complete: it goes through AutoConfig)."""
    configs = {p.name: p for p in CONFIGS.glob("*.config.json")}
    with torch.no_grad():
        for kind in (*KINDS, *MOE_KINDS):
            save_tiny_model(kind, tmp_path / kind)
            configs[kind] = tmp_path / kind / "config.json"
    assert len(configs) == 18
    for name, path in configs.items():
        raw = json.loads(path.read_text())
        # A draft's need not be: the published Llama one leaves its rope theta to the default.
        complete = name != "Llama-3.1-8B-EAGLE3.config.json"
        assert config_is_complete(raw) == complete, name
        expected = _through_transformers(raw, tmp_path / f"hf-{name}")
        assert ModelConfig.from_pretrained(path) == expected, name


@pytest.mark.parametrize(
    ("reference", "left_out", "given"),
    [
        # Qwen3's default head_dim is 128, not hidden / heads (64 here)
        ("Qwen3-8B", "head_dim", {"num_attention_heads": 64}),
        ("Mixtral-8x7B-Instruct-v0.1", "rope_theta", {}),  # Mixtral's default theta is 1e6
        ("Llama-3.1-8B-Instruct", "eos_token_id", {}),  # Llama's default eos is 2
        ("Qwen3-30B-A3B", "num_experts", {}),
    ],
)
def test_incomplete_configs_take_the_familys_defaults(
    tmp_path: Path, reference: str, left_out: str, given: dict[str, int]
) -> None:
    raw = json.loads((CONFIGS / f"{reference}.config.json").read_text()) | given
    raw.pop(left_out)
    assert not config_is_complete(raw)
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "config.json").write_text(json.dumps(raw))
    parsed = ModelConfig.from_pretrained(tmp_path / "given")
    assert parsed == _through_transformers(raw, tmp_path / "hf")
    assert parsed != ModelConfig.from_dict(raw)


@pytest.mark.parametrize("eos_form", ["dict", "str"])
def test_eos_union(tmp_path: Path, eos_form: str) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    raw = json.loads((CONFIGS / "Qwen3-8B.config.json").read_text())
    raw["eos_token_id"] = [11, 12]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = ModelConfig.from_pretrained(tmp_path)
    assert load_eos_ids(tmp_path, config) == {11, 12}  # no tokenizer files: ids only
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 13}))
    vocab = {"<unk>": 0, "hello": 1, "<|im_end|>": 14}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    eos = {"content": "<|im_end|>", "special": True} if eos_form == "dict" else "<|im_end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    assert load_eos_ids(tmp_path / "config.json", config) == {11, 12, 13, 14}
