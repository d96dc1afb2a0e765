"""Stage 4 (``regenerate``): the target's own answers to train prompts (draft training data).

For every train conversation (or a seeded sample of ``count``), the prompt is the longest
prefix that ends with a user turn and, rendered through the chat template with the generation
prompt, leaves room for ``max_new_tokens`` within the target's context; conversations whose
first question is already too long are passed over. Answers are greedy, generated in
left-padded batches with transformers' ``generate``, and cut after the first ``<|im_end|>``
(kept). Rows of ``regenerated.jsonl``: ``{"id", "messages", "answer_ids", "finished"}``
in sample order; ``finished`` is false when the answer hit ``max_new_tokens``.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recipe import chat, data, model, packing, target
from recipe.manifest import Manifest, Produced, canonical_json, input_hashes, require, run_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REGENERATED = "regenerated.jsonl"
VERSION = 1  # bump when the outputs for a given config change


@dataclass(frozen=True)
class RegenerateConfig:
    count: int = 0  # the drafts' training set; 0: every conversation with a prompt (13,690)
    max_new_tokens: int = 256
    batch_size: int = 2048  # batch composition can change bf16 greedy answers: part of the key
    seed: int = 0


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[chat.Message]
    ids: list[int]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[chat.Message]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_for(
    conversation: data.Conversation, tokenizer: PreTrainedTokenizerBase, max_tokens: int
) -> Prompt | None:
    """The longest prefix ending with a user turn that fits in ``max_tokens``, or None."""
    best: Prompt | None = None
    for end, message in enumerate(conversation.messages):
        if message["role"] != chat.USER:
            continue
        prefix = conversation.messages[: end + 1]
        ids = encode_prompt(tokenizer, prefix)
        if len(ids) > max_tokens:
            break
        best = Prompt(conversation.id, prefix, ids)
    return best


def select_prompts(
    path: Path, tokenizer: PreTrainedTokenizerBase, config: RegenerateConfig, max_tokens: int
) -> list[Prompt]:
    conversations = list(data.read_jsonl(path))
    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    prompts: list[Prompt] = []
    for index in order:
        prompt = prompt_for(conversations[index], tokenizer, max_tokens)
        if prompt is not None:
            prompts.append(prompt)
            if len(prompts) == config.count:  # never true for count 0
                break
    return prompts


def cut_answer(new_tokens: list[int]) -> tuple[list[int], bool]:
    """(answer up to and including the first eos, whether there was one). Padding only ever
    follows an eos, so an answer without eos has no padding to strip."""
    if model.EOS_ID in new_tokens:
        return new_tokens[: new_tokens.index(model.EOS_ID) + 1], True
    return new_tokens, False


@torch.no_grad()
def generate_batch(
    net: Any, prompts: list[Prompt], max_new_tokens: int, device: str
) -> list[tuple[list[int], bool]]:
    width = max(len(p.ids) for p in prompts)
    input_ids = torch.full((len(prompts), width), model.PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt.ids) :] = torch.tensor(prompt.ids)
        attention_mask[row, width - len(prompt.ids) :] = 1
    # out: [B, width + new]
    out = net.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=model.EOS_ID,
        pad_token_id=model.PAD_ID,
    )
    return [cut_answer(row) for row in out[:, width:].tolist()]


def load_target(directory: Path, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    net: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    return net.to(device).eval()


def regenerate(
    prompts: list[Prompt], net: Any, config: RegenerateConfig, device: str
) -> list[tuple[list[int], bool]]:
    """Answers in the order of ``prompts``; batches are formed from length-sorted prompts."""
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    answers: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    started = time.monotonic()
    for start in range(0, len(by_length), config.batch_size):
        chunk = by_length[start : start + config.batch_size]
        batch = generate_batch(net, [prompts[i] for i in chunk], config.max_new_tokens, device)
        for i, answer in zip(chunk, batch, strict=True):
            answers[i] = answer
        done = start + len(chunk)
        print(f"[regenerate] {done}/{len(prompts)} ({time.monotonic() - started:.1f} s)")
    return answers


def run(config: RegenerateConfig, out: Path, device: str) -> Manifest:
    """Stage 4: needs stages 1 and 3."""
    data_manifest = require(out / "data", "data")
    target_manifest = require(out / "target", "target")
    target_dir = out / "target" / target.EXPORT_DIR

    def produce(stage_dir: Path) -> Produced:
        started = time.monotonic()
        tokenizer = packing.load_tokenizer(target_dir)
        net = load_target(target_dir, device)
        max_prompt = net.config.max_position_embeddings - config.max_new_tokens
        if max_prompt <= 0:
            raise ValueError(f"max_new_tokens leaves no room for a prompt in {max_prompt} tokens")
        prompts = select_prompts(out / "data" / data.TRAIN, tokenizer, config, max_prompt)
        answers = regenerate(prompts, net, config, device)
        with (stage_dir / REGENERATED).open("w", encoding="utf-8", newline="\n") as f:
            for prompt, (ids, finished) in zip(prompts, answers, strict=True):
                row = {"id": prompt.id, "messages": prompt.messages}
                f.write(canonical_json(row | {"answer_ids": ids, "finished": finished}) + "\n")
        stats = _stats(answers, time.monotonic() - started, device)
        print(f"[regenerate] {stats}")
        return Produced([REGENERATED], stats)

    inputs = input_hashes(data_manifest, target_manifest)
    identity = asdict(config) | {"version": VERSION}
    manifest = run_once("regenerate", out / "regenerate", identity, inputs, produce)
    assert manifest is not None  # this stage always finishes
    return manifest


def _stats(answers: list[tuple[list[int], bool]], seconds: float, device: str) -> dict[str, Any]:
    tokens = sum(len(ids) for ids, _ in answers)
    return {
        "conversations": len(answers),
        "finished": sum(finished for _, finished in answers),
        "answer_tokens": tokens,
        "seconds": round(seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
    }
