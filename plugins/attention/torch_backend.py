"""The built-in ``torch`` attention backend's spec: SDPA over the paged cache. Runs anywhere
torch runs; the reference the faster backends are checked against."""

from __future__ import annotations

from outrider.plugins.api import AttentionCapabilities, PluginSpec

SPEC = PluginSpec(
    name="torch",
    kind="attention",
    summary="PyTorch scaled_dot_product_attention over the paged KV cache (reference, any device)",
    implementation="outrider.plugins.attention.torch_impl:TorchAttention",
    attention=AttentionCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float32", "bfloat16", "float16"}),
        page_sizes=None,
        non_causal=True,
        tree_mask=True,
        sliding_window=True,
        sinks=True,
        cuda_graphs=True,
        graph_kv_bound=True,  # the K/V gather and the mask span max_kv
    ),
)
