"""ARCHITECTURE.md 4.4's numeric rule for GPU outputs, over greedy outputs that carry their
top-2 log-probabilities (``logprobs=2``).

Two paths over the same requests may round differently, so greedy tokens may part where the
reference's two best candidates nearly tie. Up to the first divergence both saw the same
tokens (teacher-forced), where the rule bounds the logits' difference by ``max_diff``: a
log-probability is a logit less the position's log-normaliser, which moves by at most as much,
so the chosen token's log-probabilities differ by at most twice ``max_diff``. At the first
divergence, the reference's top-2 gap (the same in logits and log-probabilities) is at most
twice ``max_diff``.
"""

from __future__ import annotations

from collections.abc import Sequence

from outrider.protocol.messages import TokenLogprob

# float32 on a GPU: kernels sum in other orders than the CPU, and a mixture of experts routes
# by a top-k that such a difference can tip where two experts nearly tie.
MAX_DIFF = {"bfloat16": 0.25, "float16": 0.05, "float32": 1e-3}


def assert_within_rule(
    reference: Sequence[TokenLogprob], other: Sequence[TokenLogprob], max_diff: float
) -> bool:
    """Assert the rule for one request's outputs; True when they are equal token for token."""
    assert len(reference) == len(other), (len(reference), len(other))
    diverged = next(
        (
            i
            for i, (a, b) in enumerate(zip(reference, other, strict=True))
            if a.token_id != b.token_id
        ),
        len(reference),
    )
    for i in range(diverged):
        diff = abs(reference[i].logprob - other[i].logprob)
        assert diff <= 2 * max_diff, f"position {i}: log-probabilities {diff:.3f} apart"
    if diverged == len(reference):
        return True
    top = reference[diverged].top
    assert len(top) >= 2, "the rule needs the top-2 log-probabilities (logprobs=2)"
    gap = top[0][1] - top[1][1]
    assert gap <= 2 * max_diff, f"position {diverged}: tokens part at a top-2 gap of {gap:.3f}"
    return False
