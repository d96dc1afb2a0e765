"""The options of plugins whose draft model has a distribution to sample from (light: no
torch), and how their sampled requests draw drafts (sampled.py does the drawing).

- ``coupled`` (default): draft ``j`` is drawn from the draft's processed distribution ``q``
  (temperature, top-k, top-p as the request samples) with the very uniforms the target's own
  draw at that output index uses, and the accept keeps it while it equals the target's draw
  (accept.py's deterministic rule). Every committed token is the target's own draw, so seeded
  outputs are the target-only ones token for token (as with greedy and n-gram drafts), no
  draft probabilities travel, and trees need nothing else. The draft agrees with the target
  more often than an argmax draft whenever ``q`` is close to ``p``: with shared uniforms the
  two race winners coincide with probability at least ``(1 - d) / (1 + d)``, ``d`` their total
  variation distance, and 1 when ``q == p``.
- ``rejection``: drafts drawn with their own uniforms and kept with probability
  ``min(1, p/q)`` (the residual ``normalize(max(0, p - q))`` at the first rejection): the most
  a single chain draft can be kept, ``1 - d``, but seeded outputs differ from the target-only
  ones and each draft ships its ``q`` (``[bs, W - 1, V]``). Chains only.
- ``argmax``: the draft's argmax whatever the request's temperature (acceptance then falls to
  ``p(argmax q)`` at temperature > 0).

Greedy rows draft the argmax under every mode, so a batch mixing greedy and sampled rows gives
each its own rule.

``deferred_catch_up`` (default 128): the steps the drafting policy runs without drafts buffer
the draft's catch-up for up to this many positions a request (as does a prompt's last chunk
when it is that short), and the draft catches up on them in one batch before the request
drafts again (deferred.py): a plain step then costs what it costs without speculation. 0:
every plain step runs the draft over its token at once. A catch-up batch costs about the same
whatever its length (eager: 1-2 ms of launches on an H100; from a CUDA graph, which small
batches replay, a fraction of that), so a longer buffer pays it less often; each position
keeps the target's taps (EAGLE-3 on Llama-3.1-8B: 24 KiB, 3 MiB a request at 128).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from outrider.plugins.api import CheckContext, Problem

SampleMode = Literal["coupled", "rejection", "argmax"]
CONFIG_FLAG = "--speculative-config"


class DraftOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``--speculative-config`` of ``dflash``, ``eagle3`` and ``standalone``."""

    # How sampled requests (temperature > 0) draw their drafts: see the module docstring.
    sample: SampleMode = "coupled"
    # Positions a request's plain steps buffer for the draft's catch-up (0: none).
    deferred_catch_up: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 128


def tree_sample_problems(ctx: CheckContext) -> list[Problem]:
    """A tree verifies deterministic drafts only: ``rejection`` is refused with one."""
    if ctx.speculative_topk <= 1:
        return []
    try:
        options = msgspec.json.decode(ctx.speculative_config or b"{}", type=DraftOptions)
    except msgspec.ValidationError:
        return []  # the registry reports invalid options itself
    if options.sample != "rejection":
        return []
    return [
        Problem(
            CONFIG_FLAG,
            f'"sample": "rejection" drafts chains only, not a tree (topk {ctx.speculative_topk}): '
            'use "coupled"',
        )
    ]
