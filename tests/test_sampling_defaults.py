"""Sampling defaults: ``--generation-config auto`` reads the model directory's
generation_config.json, ``none`` keeps Outrider's; requests that leave temperature, top_p or
top_k out get the defaults at the front door, field by field, and the plugin check and the
daemon see concrete values only."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from frontdoor_harness import model_facts

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.daemon.flags import add_serve_arguments, resolve
from outrider.daemon.frontdoor.validation import Rejected, Validator
from outrider.daemon.sampling_defaults import (
    OUTRIDER_DEFAULTS,
    SamplingDefaults,
    resolve_sampling_defaults,
)
from outrider.plugins.api import RequestFacts
from outrider.plugins.sampling_spec import SamplingError, SamplingSpec, resolve_sampling
from outrider.protocol.messages import MAX_SEED, MIN_TEMPERATURE, Generate

# What Qwen3 ships, plus keys Outrider does not implement and keys that are not sampling.
QWEN3_LIKE = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "repetition_penalty": 1.05,
    "max_new_tokens": 2048,
    "min_p": None,  # null: as if absent
    "transformers_version": "4.51.0",
}
QWEN3_DEFAULTS = (0.6, 0.95, 20)


def _model(tmp_path: Path, generation: Any = None, text: str | None = None) -> Path:
    """A model directory with a config.json and, when given, a generation_config.json."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    if generation is not None:
        text = json.dumps(generation)
    if text is not None:
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


def _resolve(model: Path, *argv: str, environ: dict[str, str] | None = None) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return resolve(parser.parse_args(["--model", str(model), *argv]), environ=environ or {})


def _defaults(model: Path, *argv: str) -> SamplingDefaults:
    return resolve_sampling_defaults(_resolve(model, *argv))


def _values(d: SamplingDefaults | SamplingSpec) -> tuple[float, float, int]:
    return (d.temperature, d.top_p, d.top_k)


# --- resolution ---------------------------------------------------------------------------


def test_auto_reads_the_models_generation_config(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN3_LIKE)
    config = _resolve(model)
    assert config.generation_config == "auto"  # the default
    defaults = resolve_sampling_defaults(config)
    assert _values(defaults) == QWEN3_DEFAULTS
    assert defaults.source == f"from {model / 'generation_config.json'}"
    assert defaults.ignored == ("max_new_tokens", "repetition_penalty")
    assert defaults.describe() == (
        f"temperature 0.6, top_p 0.95, top_k 20 (from {model / 'generation_config.json'}; "
        "ignored, not implemented: max_new_tokens, repetition_penalty)"
    )
    # A config.json path names the same directory.
    assert _values(_defaults(model / "config.json")) == QWEN3_DEFAULTS


def test_none_ignores_the_file(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN3_LIKE)
    for config in (
        _resolve(model, "--generation-config", "none"),
        _resolve(model, environ={"OUTRIDER_GENERATION_CONFIG": "none"}),
    ):
        defaults = resolve_sampling_defaults(config)
        assert _values(defaults) == (1.0, 1.0, 0)
        assert defaults.describe() == (
            "temperature 1, top_p 1, top_k 0 (Outrider's defaults: --generation-config none)"
        )
    with pytest.raises(ConfigError, match="--generation-config: 'vllm' is not one of auto, none"):
        _resolve(model, environ={"OUTRIDER_GENERATION_CONFIG": "vllm"})


def test_do_sample_false_is_greedy(tmp_path: Path) -> None:
    greedy = _defaults(_model(tmp_path / "a", {"do_sample": False, "top_k": 5}))
    assert _values(greedy) == (0.0, 1.0, 5)
    # As Hugging Face's generate: do_sample false wins over a temperature.
    assert (
        _defaults(_model(tmp_path / "b", {"do_sample": False, "temperature": 0.7})).temperature == 0
    )
    assert _defaults(_model(tmp_path / "c", {"temperature": 0})).temperature == 0
    # do_sample true (or absent) with values: those values.
    sampled = _defaults(_model(tmp_path / "d", {"do_sample": True, "temperature": 0.7}))
    assert _values(sampled) == (0.7, 1.0, 0)


def test_without_sampling_keys_outriders_defaults_apply(tmp_path: Path) -> None:
    no_file = _defaults(_model(tmp_path / "none"))
    assert _values(no_file) == (1.0, 1.0, 0)
    assert (
        no_file.source == "Outrider's defaults: the model directory has no generation_config.json"
    )
    # What save_pretrained writes for a model without generation settings.
    written = {
        "_from_model_config": True,
        "bos_token_id": 1,
        "eos_token_id": [1, 2],
        "output_attentions": False,
        "output_hidden_states": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
    }
    defaults = _defaults(_model(tmp_path / "hf", written))
    assert (_values(defaults), defaults.ignored) == ((1.0, 1.0, 0), ())


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "not JSON"),
        ("[0.6]", "not a JSON object"),
        ('{"temperature": "hot"}', "Expected `float | null`, got `str` - at `$.temperature`"),
        ('{"temperature": 101}', "Expected `float` <= 100.0 - at `$.temperature`"),
        ('{"temperature": 1e-6}', "temperature must be 0 (greedy) or in [1e-05, 100], got 1e-06"),
        ('{"top_p": 0}', "Expected `float` > 0.0 - at `$.top_p`"),
        ('{"top_k": -1}', "Expected `int` >= 0 - at `$.top_k`"),
        ('{"top_k": 2.5}', "Expected `int | null`, got `float` - at `$.top_k`"),
        ('{"do_sample": "yes"}', "Expected `bool | null`, got `str` - at `$.do_sample`"),
    ],
)
def test_a_malformed_file_is_a_config_error_naming_the_flag(
    tmp_path: Path, text: str, problem: str
) -> None:
    model = _model(tmp_path, text=text)
    with pytest.raises(ConfigError) as err:
        _defaults(model)
    where = f"--generation-config auto: {model / 'generation_config.json'}: "
    assert str(err.value).startswith(where), str(err.value)
    assert problem in str(err.value)
    # With none the file is not read at all.
    assert _defaults(model, "--generation-config", "none") == SamplingDefaults(
        source="Outrider's defaults: --generation-config none"
    )


# --- applied at the front door ------------------------------------------------------------

VOCAB = 100
QWEN3 = SamplingDefaults(0.6, 0.95, 20, source="test")


def _admit(validator: Validator, **fields: Any) -> SamplingSpec:
    msg = Generate(request_id="r", input_ids=[5, 6], seed=1, **fields)
    return validator.admit(msg, validator.check(msg), [5, 6]).sampling


def test_left_out_fields_get_the_defaults_given_ones_are_kept() -> None:
    validator = Validator(model_facts(None, VOCAB), None, None, QWEN3)
    assert _values(_admit(validator)) == QWEN3_DEFAULTS
    assert _values(_admit(validator, temperature=1.0, top_p=1.0, top_k=0)) == (1.0, 1.0, 0)
    assert _values(_admit(validator, temperature=0.0)) == (0.0, 0.95, 20)
    assert _values(_admit(validator, top_p=0.5)) == (0.6, 0.5, 20)
    assert _values(_admit(validator, top_k=3)) == (0.6, 0.95, 3)
    assert _values(_admit(validator, temperature=-0.0)) == (0.0, 0.95, 20)
    # No defaults given: Outrider's, as before the fields could be left out.
    plain = Validator(model_facts(None, VOCAB), None, None)
    assert plain.defaults == OUTRIDER_DEFAULTS
    assert _values(_admit(plain)) == (1.0, 1.0, 0)


def test_request_bounds_are_unchanged_and_skip_left_out_fields() -> None:
    validator = Validator(model_facts(None, VOCAB), None, None, QWEN3)
    for fields, field in (({"temperature": 1e-6}, "temperature"), ({"top_k": VOCAB + 1}, "top_k")):
        msg = Generate(request_id="r", input_ids=[5], **fields)
        with pytest.raises(Rejected) as err:
            validator.check(msg)
        assert err.value.code == "invalid_request" and err.value.message.startswith(field)


def test_a_default_top_k_past_the_vocabulary_keeps_every_token() -> None:
    wide = SamplingDefaults(0.6, 0.95, VOCAB + 1)
    validator = Validator(model_facts(None, VOCAB), None, None, wide)
    assert _values(_admit(validator)) == (0.6, 0.95, 0)
    exact = Validator(model_facts(None, VOCAB), None, None, SamplingDefaults(top_k=VOCAB))
    assert _admit(exact).top_k == VOCAB


def test_the_speculative_check_sees_the_resolved_values() -> None:
    seen: list[RequestFacts] = []

    def greedy_only(facts: RequestFacts) -> str | None:
        seen.append(facts)
        return None if facts.temperature == 0 else f"greedy only, got {facts.temperature}"

    sampled = Validator(model_facts(None, VOCAB), None, greedy_only, QWEN3)
    msg = Generate(request_id="r", input_ids=[5])
    with pytest.raises(Rejected) as err:
        sampled.admit(msg, sampled.check(msg), [5])
    assert (err.value.code, err.value.message) == ("unsupported", "greedy only, got 0.6")
    assert (seen[-1].temperature, seen[-1].top_p, seen[-1].top_k) == QWEN3_DEFAULTS
    assert _admit(sampled, temperature=0.0).temperature == 0.0
    greedy = Validator(model_facts(None, VOCAB), None, greedy_only, SamplingDefaults(0.0))
    assert _admit(greedy).temperature == 0.0


def test_resolve_sampling_is_the_one_check_of_request_and_file_values() -> None:
    qwen3 = QWEN3.sampling
    resolved = resolve_sampling(None, None, None, defaults=qwen3, seed=3, logprobs=2)
    assert resolved == SamplingSpec(0.6, 0.95, 20, seed=3, logprobs=2)
    assert resolve_sampling(-0.0, 0.5, 1, defaults=qwen3, seed=0) == SamplingSpec(0.0, 0.5, 1)
    assert 0 <= resolve_sampling(None, None, None, defaults=qwen3).seed <= MAX_SEED
    # Only a given top_k is held to the vocabulary; the defaults already fit the model.
    assert resolve_sampling(None, None, None, defaults=qwen3, vocab_size=10).top_k == 20
    with pytest.raises(SamplingError, match=r"^top_k must be 0 \(off\) or in \[1, 10\]"):
        resolve_sampling(None, None, 11, defaults=qwen3, vocab_size=10)
    with pytest.raises(SamplingError, match=r"^temperature must be 0 \(greedy\) or in \[1e-05"):
        resolve_sampling(MIN_TEMPERATURE / 2, None, None, defaults=qwen3)
    assert resolve_sampling(MIN_TEMPERATURE, None, None, defaults=qwen3).temperature > 0
