"""Stage 2 (``tokenizer``): a byte-level BPE trained on the train split only.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (eos ``<|im_end|>``, pad
``<|endoftext|>``, the ChatML template under ``chat_template``), which transformers'
``AutoTokenizer`` loads. The specials take ids 0..3; ``<|mask|>`` is asserted absent from
the encoded train and held-out conversations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from recipe import chat, data
from recipe.manifest import Manifest, Produced, input_hashes, require, run_once

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
VERSION = 1  # bump when the outputs for a given config change
_VOCAB_MULTIPLE = 64
_ENCODE_BATCH = 256


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8192  # specials included
    min_frequency: int = 2

    def __post_init__(self) -> None:
        if self.vocab_size % _VOCAB_MULTIPLE:
            raise ValueError(f"vocab_size must be a multiple of {_VOCAB_MULTIPLE}")
        if self.vocab_size > 1 << 16:
            raise ValueError("vocab_size must fit in 16 bits (token files are uint16)")


def training_texts(path: Path) -> Iterator[str]:
    """Each message as the template lays it out between the specials: role, newline, text."""
    for conversation in data.read_jsonl(path):
        for message in conversation.messages:
            yield f"{message['role']}\n{message['content']}"


def train_bpe(texts: Iterator[str], config: TokenizerConfig) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(chat.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != config.vocab_size:
        raise ValueError(
            f"the trainer stopped at {tokenizer.get_vocab_size()} tokens, short of "
            f"{config.vocab_size}: too little text for this vocabulary"
        )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": chat.IM_END,
        "pad_token": chat.ENDOFTEXT,
        "unk_token": None,
        "mask_token": chat.MASK,
        "additional_special_tokens": [chat.IM_START],
        "clean_up_tokenization_spaces": False,
        "chat_template": chat.CHAT_TEMPLATE,
    }


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    expected = {token: i for i, token in enumerate(chat.SPECIAL_TOKENS)}
    got = {token: tokenizer.token_to_id(token) for token in chat.SPECIAL_TOKENS}
    if got != expected:
        raise ValueError(f"special tokens did not get ids 0..{len(expected) - 1}: {got}")
    return expected


def count_tokens_without_mask(tokenizer: Tokenizer, path: Path) -> tuple[int, int]:
    """(tokens, characters) of the rendered conversations in ``path``; raises if any encodes
    to the mask id."""
    mask_id = chat.SPECIAL_TOKENS.index(chat.MASK)
    tokens = chars = 0
    batch: list[str] = []
    for conversation in data.read_jsonl(path):
        batch.append(chat.render(conversation.messages))
        if len(batch) == _ENCODE_BATCH:
            tokens, chars = _add_counts(tokenizer, batch, mask_id, tokens, chars)
            batch = []
    return _add_counts(tokenizer, batch, mask_id, tokens, chars)


def _add_counts(
    tokenizer: Tokenizer, texts: list[str], mask_id: int, tokens: int, chars: int
) -> tuple[int, int]:
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        if mask_id in encoding.ids:
            raise ValueError(f"{chat.MASK} occurs in the encoded data")
        tokens += len(encoding.ids)
    return tokens, chars + sum(map(len, texts))


def run(config: TokenizerConfig, out: Path) -> Manifest:
    """Stage 2: needs stage 1's outputs."""
    data_manifest = require(out / "data", "data")

    def produce(stage_dir: Path) -> Produced:
        tokenizer = train_bpe(training_texts(out / "data" / data.TRAIN), config)
        ids = special_ids(tokenizer)
        tokenizer.save(str(stage_dir / TOKENIZER_JSON))
        config_text = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
        (stage_dir / TOKENIZER_CONFIG).write_text(config_text, encoding="utf-8")
        stats: dict[str, object] = {"vocab_size": tokenizer.get_vocab_size(), "special_ids": ids}
        for split in (data.TRAIN, data.HELDOUT):
            tokens, chars = count_tokens_without_mask(tokenizer, out / "data" / split)
            name = split.removesuffix(".jsonl")
            stats[f"{name}_tokens"] = tokens
            stats[f"{name}_chars_per_token"] = round(chars / tokens, 4)
        print(f"[tokenizer] {stats}")
        return Produced([TOKENIZER_JSON, TOKENIZER_CONFIG], stats)

    inputs = input_hashes(data_manifest)
    identity = asdict(config) | {"version": VERSION}
    manifest = run_once("tokenizer", out / "tokenizer", identity, inputs, produce)
    assert manifest is not None  # this stage always finishes
    return manifest
