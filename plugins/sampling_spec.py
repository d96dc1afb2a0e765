"""``SamplingSpec``: one request's sampling parameters, from the front door to the scheduler,
and ``resolve_sampling``, the one place they are defaulted and checked.

- The wire's decoding (protocol/messages.py: ``Temperature``, ``TopP``, ``TopK``, ``Seed``)
  enforces each value's closed range; ``resolve_sampling`` adds what a decoder cannot: the
  gap between greedy and ``MIN_TEMPERATURE``, and ``top_k`` and the tokens of ``logit_bias``
  against the model's vocabulary.
- A ``SamplingSpec`` holds concrete values only: what a request leaves out has taken its
  default before any plugin or the scheduler sees it. A temperature of 0 (never -0.0) is
  greedy.
- No torch here: the front door, which never imports torch, builds every spec.
"""

from __future__ import annotations

import secrets

from msgspec import Struct

from outrider.protocol.messages import MAX_SEED, MAX_TEMPERATURE, MIN_TEMPERATURE


class SamplingSpec(Struct, array_like=True, frozen=True, gc=False):
    """The sampling parameters of one request (the rows of a ``SamplingBatch``), and the
    adjustments of its logits (daemon/engine/penalties.py)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int = 0
    logprobs: int = 0  # top-n alternatives; 0 = none
    min_p: float = 0.0  # 0 = no cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct

    @property
    def adjusts(self) -> bool:
        """Whether the request changes its logits (a bias or a penalty)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def cuts(self) -> bool:
        """Whether a row of this spec cuts its vocabulary by top-k or top-p (a greedy row never
        samples, so never cuts)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)


class SamplingError(ValueError):
    """A sampling value outside its limits; the message starts with the field's name."""


def resolve_sampling(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    *,
    defaults: SamplingSpec,
    seed: int | None = None,
    logprobs: int = 0,
    vocab_size: int | None = None,
    adjustments: Adjustments | None = None,
) -> SamplingSpec:
    """The spec of decoded values: ``temperature``, ``top_p`` and ``top_k`` left out (None)
    take those of ``defaults`` (whose seed and logprobs are not read), a seed left out is
    drawn at random.

    Raises ``SamplingError`` for a temperature between 0 and ``MIN_TEMPERATURE``, or a given
    top_k or logit_bias token past ``vocab_size`` (None: not checked). ``defaults`` must
    already fit the model.
    """
    if temperature is None:
        temperature = defaults.temperature
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise SamplingError(
            f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
            f"got {temperature!r}"
        )
    if top_k is None:
        top_k = defaults.top_k
    elif vocab_size is not None and top_k > vocab_size:
        raise SamplingError(
            f"top_k must be 0 (off) or in [1, {vocab_size}] (vocab_size), got {top_k}"
        )
    adjust = adjustments or Adjustments()
    if vocab_size is not None:
        for token_id in adjust.logit_bias:
            if token_id >= vocab_size:
                raise SamplingError(
                    f"logit_bias names token {token_id}: vocab_size is {vocab_size}"
                )
    return SamplingSpec(
        temperature=temperature if temperature > 0.0 else 0.0,  # -0.0 decodes: greedy as 0
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=top_k,
        seed=secrets.randbelow(MAX_SEED + 1) if seed is None else seed,
        logprobs=logprobs,
        min_p=adjust.min_p,
        presence_penalty=adjust.presence_penalty,
        frequency_penalty=adjust.frequency_penalty,
        repetition_penalty=adjust.repetition_penalty,
        logit_bias=tuple(sorted(adjust.logit_bias.items())),
    )


class Adjustments(Struct, frozen=True):
    """A request's ``min_p``, penalties and logit bias as decoded (the wire's ranges hold)."""

    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
