"""A model directory for benchmarks with dummy weights: a model's config.json beside a real
tokenizer of about Llama-3's size, its ``vocab_size`` set to the tokenizer's.

The tokenizer is DeepSeek-V3's (byte-level BPE, 128,000 merges' pieces and 1,280 added
tokens: 129,280 ids), which the ``litellm`` wheel on the package index carries as
``deepseek_tokenizer.json``. A grammar's masks cost what the tokenizer's pieces make them
cost: a widened tokenizer (``wide_tokenizer.py``, pieces joined two by two) fills a mask
inside a JSON string several times slower than a real one, so host-time figures of
constrained decoding take a real vocabulary.

    python benchmarks/real_vocab.py OUT_DIR [--config CONFIG_JSON]

``--config``: the Llama-3.1-8B fixture unless given.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LITELLM = "1.110.2"
MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def tokenizer_json() -> bytes:
    """DeepSeek-V3's tokenizer.json, from the ``litellm`` wheel (downloaded, no dependencies)."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder]
        subprocess.run([*command, f"litellm=={LITELLM}"], check=True)
        (wheel,) = Path(folder).glob("litellm-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(MEMBER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--config",
        type=Path,
        default=ROOT / "tests" / "fixtures" / "configs" / "Llama-3.1-8B-Instruct.config.json",
    )
    args = parser.parse_args()
    data = tokenizer_json()
    spec = json.loads(data)
    size = len(spec["model"]["vocab"]) + sum(
        1 for token in spec["added_tokens"] if token["content"] not in spec["model"]["vocab"]
    )
    config = json.loads(args.config.read_text())
    config["vocab_size"] = size
    bos, eos = (
        next(token["id"] for token in spec["added_tokens"] if token["content"] == text)
        for text in (BOS, EOS)
    )
    config["bos_token_id"], config["eos_token_id"] = bos, eos
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.json").write_bytes(data)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                        "eos_token": EOS, "model_max_length": 131072}  # fmt: skip
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{args.out}: {size} ids, the config of {args.config.name}")


if __name__ == "__main__":
    main()
