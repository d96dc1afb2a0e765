"""CPU smoke tests of the recipe's draft stages (``eagle3``, ``dflash``) on the tiny pipeline
of ``test_recipe`` (four-layer target, 512-token vocabulary) with a few dozen regenerated
answers: the exports are in the public layouts, the daemon's loaders and an in-process engine
take them, the training twins compute what the daemon's draft models compute, and a stopped
run resumes to the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from draft_fixtures import DenseShape, unrolled_logits
from engine_harness import engine_for, request, run
from model_fixtures import PagedRows, torch_backend
from safetensors.torch import load_file
from test_recipe import CPU, TARGET, VOCAB, run_data, slice_source

from outrider.plugins.models.weights import checkpoint_tensors
from outrider.plugins.speculative.dflash_model import load_dflash
from outrider.plugins.speculative.eagle3_model import load_eagle3
from recipe import (
    dflash_train,
    draft_data,
    draft_loop,
    eagle3_train,
    family,
    model,
    packing,
    regenerate,
    target,
    tokenizer,
)
from recipe.dflash_net import DFlashNet
from recipe.draft_layers import DraftShape
from recipe.eagle3_net import Eagle3Net
from recipe.manifest import Manifest, stage_key

REGENERATE = regenerate.RegenerateConfig(count=24, max_new_tokens=24, batch_size=24)
EAGLE3 = eagle3_train.Eagle3StageConfig(
    aux_layer_ids=(0, 1, 2),
    draft_vocab_size=128,
    intermediate_size=96,
    steps=3,
    epochs=1.0,
    batch_size=6,
    eval_prompts=3,
    eval_new_tokens=12,
    eval_chains=(2, 3),
    export_dtype="float32",
)
DFLASH = dflash_train.DFlashStageConfig(
    target_layer_ids=(0, 2),
    block_size=4,
    intermediate_size=96,
    max_anchors=8,
    epochs=1.0,
    batch_size=6,
    eval_prompts=3,
    eval_new_tokens=12,
    export_dtype="float32",
)
EXPORT_FILES = ["model/README.md", "model/config.json", "model/model.safetensors"]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output root after every stage up to the drafts (tiny target, 24 answers)."""
    root = tmp_path_factory.mktemp("drafts-out")
    source, limit = slice_source(tmp_path_factory.mktemp("source"))
    run_data(root, source, limit)
    tokenizer.run(tokenizer.TokenizerConfig(vocab_size=VOCAB), root)
    assert target.run(TARGET, CPU, root) is not None
    regenerate.run(REGENERATE, root, "cpu")
    return root


@pytest.fixture(scope="module")
def eagle3(out: Path) -> Manifest:
    manifest = eagle3_train.run(EAGLE3, draft_loop.DraftRuntime(device="cpu"), out)
    assert manifest is not None
    return manifest


@pytest.fixture(scope="module")
def dflash(out: Path) -> Manifest:
    manifest = dflash_train.run(DFLASH, draft_loop.DraftRuntime(device="cpu"), out)
    assert manifest is not None
    return manifest


def _target_config(out: Path) -> dict[str, object]:
    path = out / "target" / target.EXPORT_DIR / "config.json"
    loaded: dict[str, object] = json.loads(path.read_text())
    return loaded


def test_greedy_walk_counts_as_the_scheduler() -> None:
    # Prompt of 2 tokens, then 0 1 2 3 4 5 6 as the target's continuation (ids 10..16).
    sequences = draft_data.from_pairs([[7, 8]], [list(range(10, 17))])
    drafts = torch.full((1, 9, 2), -1, dtype=torch.int64)
    drafts[0, 2] = torch.tensor([11, 12])  # both right: commit 3 (root moves to 5)
    drafts[0, 5] = torch.tensor([14, 99])  # one right: commit 2 (root moves to 7)
    walk = draft_data.greedy_walk(drafts, sequences, new_tokens=6)
    assert (walk.verifies, walk.per_position) == (2, [2, 1])
    assert walk.tau == pytest.approx(2.5)


def test_vocab_and_anchors() -> None:
    vocab = eagle3_train.select_vocab(torch.tensor([0, 5, 1, 5, 9, 0]), 3)
    assert vocab.ids.tolist() == [1, 3, 4]  # ties by id
    assert vocab.d2t.tolist() == [1, 2, 2] and vocab.in_vocab.tolist() == [0, 1, 0, 1, 1, 0]
    sequences = draft_data.from_pairs([[1, 2], [1]], [[5, 6, 7], [8]])
    candidates = dflash_train.anchor_candidates(sequences)
    assert candidates.tolist() == [[False, False, True, True, False], [False] * 5]
    anchors, valid = dflash_train.sample_anchors(candidates, 8, None)
    assert sorted(anchors[0][valid[0]].tolist()) == [2, 3] and not valid[1].any()


def test_eagle3_export_layout(out: Path, eagle3: Manifest) -> None:
    assert sorted(eagle3.outputs) == EXPORT_FILES
    directory = out / "eagle3" / eagle3_train.EXPORT_DIR
    config = json.loads((directory / "config.json").read_text())
    target_config = _target_config(out)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 128
    assert config["vocab_size"] == VOCAB == target_config["vocab_size"]
    assert config["target_hidden_size"] == target_config["hidden_size"]
    eagle = config["eagle_config"]
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert "output-of-layer" in eagle["layer_id_convention"]
    tensors = load_file(directory / "model.safetensors")
    assert tensors["fc.weight"].shape == (64, 3 * 64)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert tensors["lm_head.weight"].shape == (128, 64)
    assert "embed_tokens.weight" not in tensors
    draft = load_eagle3(directory, dtype=torch.float32, device="cpu", max_positions=256)
    assert set(checkpoint_tensors(draft)) == set(tensors)
    ids = draft.to_target_ids(torch.arange(128))
    assert ids.tolist() == sorted(ids.tolist()) and int(draft.t2d.sum()) == 128
    chains = eagle3.stats["heldout_acceptance"]
    assert set(chains) == set(draft_data.FORMS)
    assert all(chains[form]["chain3"]["tau"] >= 1.0 for form in chains)
    assert eagle3.stats["steps"] == EAGLE3.optim.total_steps(REGENERATE.count)


def test_eagle3_twin_matches_the_dense_reference(out: Path, eagle3: Manifest) -> None:
    directory = out / "eagle3" / eagle3_train.EXPORT_DIR
    draft = load_eagle3(directory, dtype=torch.float32, device="cpu", max_positions=256)
    weights = load_file(directory / "model.safetensors")
    shape = DraftShape(64, 96, 4, 2, 16, 10000.0, 1e-6)
    twin = Eagle3Net(shape, 64, 128)
    twin.load_state_dict({k: v for k, v in weights.items() if k not in ("d2t", "t2d")})
    gen = torch.Generator().manual_seed(0)
    steps, width = 3, 20
    tokens = torch.randint(0, VOCAB, (2, width), generator=gen)
    taps = torch.randn(2, width, 3 * 64, generator=gen)
    embedding = torch.randn(VOCAB, 64, generator=gen)
    dense_shape = DenseShape.of(draft.config)
    reference = unrolled_logits(
        checkpoint_tensors(draft), embedding, tokens, taps, steps, dense_shape
    )
    n = width - 1 - steps
    with torch.no_grad():
        outputs = twin.unroll(embedding[tokens[:, 1 : n + steps]], taps[:, :n], steps)
    for y, expected in zip(outputs, reference, strict=True):
        torch.testing.assert_close(twin.logits(y), expected, atol=1e-4, rtol=1e-4)


def test_dflash_export_layout(out: Path, dflash: Manifest) -> None:
    assert sorted(dflash.outputs) == EXPORT_FILES
    directory = out / "dflash" / dflash_train.EXPORT_DIR
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4
    assert config["num_target_layers"] == _target_config(out)["num_hidden_layers"] == 4
    flash = config["dflash_config"]
    assert (flash["target_layer_ids"], flash["mask_token_id"]) == ([0, 2], 3)
    tensors = load_file(directory / "model.safetensors")
    assert tensors["fc.weight"].shape == (64, 2 * 64)
    assert "layers.1.self_attn.k_norm.weight" in tensors and "lm_head.weight" not in tensors
    draft = load_dflash(directory, dtype=torch.float32, device="cpu", max_positions=256)
    assert draft.config.target_layer_ids == (0, 2) and draft.config.mask_token_id == 3
    blocks = dflash.stats["heldout_acceptance"]
    assert all(blocks[form]["block4"]["tau"] >= 1.0 for form in draft_data.FORMS)


def test_dflash_twin_matches_the_daemon_draft(out: Path, dflash: Manifest) -> None:
    directory = out / "dflash" / dflash_train.EXPORT_DIR
    draft = load_dflash(directory, dtype=torch.float32, device="cpu", max_positions=256)
    twin = DFlashNet(DraftShape(64, 96, 4, 2, 16, 10000.0, 1e-6), 2, 2, 64)
    twin.load_state_dict(load_file(directory / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    context, block = 7, DFLASH.block_size
    features = torch.randn(context, 2 * 64, generator=gen)
    embeds = torch.randn(block, 64, generator=gen)
    rows = PagedRows(num_layers=2, shape=draft.attention_shape, page_size=4, max_len=16)
    backend = torch_backend(draft.attention_shape)
    with torch.no_grad():
        _, fb = rows.batch(backend, [(0, [0] * context)])
        draft.materialize(features, fb.layout, fb.kv)
        _, fb = rows.batch(backend, [(0, [3] * block)], causal=False)
        daemon = draft(embeds, fb)
        # The twin sees the features at every position and masks those from the anchor on.
        taps = torch.cat((features, torch.randn(block, 2 * 64, generator=gen)))[None]
        mine = twin(embeds[None, None], torch.tensor([[context]]), taps)[0, 0]
    torch.testing.assert_close(mine, daemon, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "settings",
    [
        {"speculative_algorithm": "eagle3", "speculative_num_steps": 3},
        {"speculative_algorithm": "dflash"},
    ],
    ids=["eagle3", "dflash"],
)
def test_engine_serves_the_drafts(
    out: Path, eagle3: Manifest, dflash: Manifest, settings: dict[str, object]
) -> None:
    model_dir = str(out / "target" / target.EXPORT_DIR)
    stage = str(settings["speculative_algorithm"])
    draft_dir = str(out / stage / "model")
    hf_tokenizer = packing.load_tokenizer(out / "target" / target.EXPORT_DIR)
    prompts = draft_data.heldout_prompts(out, hf_tokenizer, 4, 48)["messages"]
    requests = [request(i, p, max_new_tokens=16) for i, p in enumerate(prompts)]
    plain = run(engine_for(model_dir, dtype="float32", context_length=128), requests)
    engine = engine_for(
        model_dir, dtype="float32", context_length=128, draft_model=draft_dir, **settings
    )
    speculative = run(engine, requests)
    assert {r: o.token_ids for r, o in speculative.items()} == {
        r: o.token_ids for r, o in plain.items()
    }
    assert engine.scheduler.counters().spec_drafts > 0


def test_eagle3_resumes_to_the_same_weights(out: Path, eagle3: Manifest, tmp_path: Path) -> None:
    for stage in ("data", "tokenizer", "target", "regenerate"):
        (tmp_path / stage).symlink_to(out / stage)
    halfway = draft_loop.DraftRuntime(device="cpu", max_steps_this_call=2)
    assert eagle3_train.run(EAGLE3, halfway, tmp_path) is None
    assert (tmp_path / "eagle3" / draft_loop.CHECKPOINT).is_file()
    resumed = eagle3_train.run(EAGLE3, draft_loop.DraftRuntime(device="cpu"), tmp_path)
    assert resumed is not None and resumed.outputs == eagle3.outputs
    assert resumed.stats["heldout_acceptance"] == eagle3.stats["heldout_acceptance"]
    again = eagle3_train.run(EAGLE3, draft_loop.DraftRuntime(device="cpu"), tmp_path)
    assert again is not None and (again.key, again.outputs) == (resumed.key, resumed.outputs)


def _upstream_copy(out: Path, root: Path) -> Path:
    for stage in ("data", "tokenizer", "regenerate"):
        shutil.copytree(out / stage, root / stage)
    return root


def test_family_target_adopted_for_the_drafts(
    out: Path, eagle3: Manifest, dflash: Manifest, tmp_path: Path
) -> None:
    """``adopt-target`` takes a family's target as stage 3 of an output root built from the
    same data and tokenizer (the draft stages then read it), and refuses tampered weights."""
    dest = tmp_path / "family"
    assert family.run(family.FamilyConfig(count=2), out, dest) is not None
    fresh = _upstream_copy(out, tmp_path / "fresh")
    adopted = family.adopt_target(fresh, dest)
    assert adopted is not None and adopted.stats["adopted_from"] == str(dest)
    assert adopted.key == stage_key(
        target.stage_identity(target.TargetConfig()), target.stage_inputs(fresh)
    )
    for name in model.EXPORT_FILES:
        copied = fresh / "target" / target.EXPORT_DIR / name
        assert copied.read_bytes() == (dest / "target" / name).read_bytes()
    inputs = draft_loop.draft_stage_inputs(fresh)
    assert inputs["target/model/model.safetensors"] == adopted.outputs["model/model.safetensors"]
    assert family.adopt_target(fresh, dest) == adopted  # complete: skipped

    weights = dest / "target" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ValueError, match="differs from the family manifest"):
        family.adopt_target(_upstream_copy(out, tmp_path / "other"), dest)
