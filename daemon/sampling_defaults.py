"""Sampling defaults: what a request that leaves ``temperature``, ``top_p`` or ``top_k`` out
gets. The daemon resolves them once, before it spawns or loads anything, from
``--generation-config``; the front door applies them field by field.

- ``auto``: the model directory's generation_config.json when it has one, read as Hugging
  Face's ``generate`` reads it: ``do_sample: false`` is greedy (temperature 0). A value the file
  does not give keeps Outrider's own (so no top_k of 50, ``GenerationConfig``'s default). Keys
  that steer generation in ways Outrider does not implement (``repetition_penalty``,
  ``max_new_tokens``, ``min_p``, ...) are ignored, and named in the log.
- ``none``, or ``auto`` without the file: Outrider's own, temperature 1.0, top_p 1.0, top_k 0.

The file's values decode as a request's do (protocol/messages.py) and are resolved by the same
``resolve_sampling`` (plugins/sampling_spec.py). A file that cannot be used (not JSON, a value
of the wrong type or out of the bounds a request has) stops the start with a ``ConfigError``
naming ``--generation-config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from outrider.daemon.config import ConfigError, ServeConfig
from outrider.plugins.models.config import model_dir
from outrider.plugins.sampling_spec import SamplingError, SamplingSpec, resolve_sampling
from outrider.protocol.messages import Temperature, TopK, TopP

GENERATION_CONFIG_FLAG = "--generation-config"
GENERATION_CONFIG_FILE = "generation_config.json"

# generation_config.json keys that do not change what is sampled: token ids (the EOS set is
# read by the model loader), output switches and bookkeeping. Any other key but the ones read
# here is reported as ignored.
_NOT_SAMPLING = frozenset(
    {
        "_from_model_config",
        "bos_token_id",
        "decoder_start_token_id",
        "eos_token_id",
        "output_attentions",
        "output_hidden_states",
        "output_logits",
        "output_scores",
        "pad_token_id",
        "return_dict_in_generate",
        "transformers_version",
        "use_cache",
    }
)


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request's left-out sampling fields take, and where they came from."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    source: str = "Outrider's defaults"
    ignored: tuple[str, ...] = ()  # keys of the file that Outrider does not implement

    @property
    def sampling(self) -> SamplingSpec:
        """The defaults as the values ``resolve_sampling`` fills in."""
        return SamplingSpec(self.temperature, self.top_p, self.top_k)

    def describe(self) -> str:
        """One line for the start-up log: the values, their source, the keys ignored."""
        ignored = f"; ignored, not implemented: {', '.join(self.ignored)}" if self.ignored else ""
        return (
            f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k} "
            f"({self.source}{ignored})"
        )


OUTRIDER_DEFAULTS = SamplingDefaults()


class _GenerationFile(msgspec.Struct):
    """The keys of generation_config.json read here; null is the same as absent."""

    do_sample: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None


_KNOWN_KEYS = frozenset(_GenerationFile.__struct_fields__) | _NOT_SAMPLING


def resolve_sampling_defaults(config: ServeConfig) -> SamplingDefaults:
    """The defaults ``config`` serves with; raises ``ConfigError`` for an unusable file."""
    if config.generation_config == "none":
        return SamplingDefaults(source=f"Outrider's defaults: {GENERATION_CONFIG_FLAG} none")
    path = model_dir(config.model) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults(
            source=f"Outrider's defaults: the model directory has no {GENERATION_CONFIG_FILE}"
        )
    return read_generation_config(path)


def read_generation_config(path: Path) -> SamplingDefaults:
    """The defaults a generation_config.json gives; raises ``ConfigError``."""
    where = f"{GENERATION_CONFIG_FLAG} auto: {path}"
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a JSON object")
    try:
        given = msgspec.convert(raw, _GenerationFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    # As Hugging Face's generate: do_sample false is greedy, whatever the temperature.
    temperature = 0.0 if given.do_sample is False else given.temperature
    try:
        sampling = resolve_sampling(
            temperature, given.top_p, given.top_k, defaults=OUTRIDER_DEFAULTS.sampling, seed=0
        )
    except SamplingError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return SamplingDefaults(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        source=f"from {path}",
        ignored=tuple(sorted(k for k, v in raw.items() if v is not None and k not in _KNOWN_KEYS)),
    )
