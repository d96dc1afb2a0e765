"""Outrider's embedded model family (data only): ``target/`` (a Qwen3 causal LM with its
tokenizer), ``dflash/`` and ``eagle3/`` (its drafts). See MODEL_CARD.md."""
