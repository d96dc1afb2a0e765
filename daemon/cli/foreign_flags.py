"""The parser of every ``outrider`` subcommand: an unknown flag is refused with that
subcommand's usage, and a flag from vLLM's (or SGLang's) habits gets a hint at ours.

A hint names only a flag the subcommand has: ``--port`` is ``--http`` for ``serve`` and
``--connect`` for ``generate``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

# A foreign flag -> our flags that do its job, the first one a subcommand has wins.
FOREIGN_FLAGS: dict[str, tuple[str, ...]] = {
    "--port": ("--http", "--connect"),
    "--host": ("--http", "--connect"),
    "--max-tokens": ("--max-new-tokens",),
    "--max-model-len": ("--context-length",),
    "--tensor-parallel-size": ("--tp",),
    "-tp": ("--tp",),
    "--gpu-memory-utilization": ("--gpu-memory-fraction",),
    "--max-num-seqs": ("--max-running",),
    "--max-num-batched-tokens": ("--chunked-prefill-tokens",),
    "--enforce-eager": ("--disable-cuda-graph",),
    "--num-speculative-tokens": ("--speculative-num-draft-tokens",),
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: refuses unknown arguments itself, under its own usage."""

    def parse_known_args(  # type: ignore[override]  # argparse's overloads: one shape used
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self._unrecognized(extras))
        return parsed, extras

    def _unrecognized(self, extras: list[str]) -> str:
        lines = [f"unrecognized arguments: {' '.join(extras)}"]
        for given in dict.fromkeys(arg.split("=", 1)[0] for arg in extras):
            hint = self._hint(given)
            if hint is not None:
                lines.append(f"  {given}: did you mean {hint}?")
        return "\n".join(lines)

    def _hint(self, foreign: str) -> str | None:
        """Our flag (with its metavar) that does the job of ``foreign``, if this has one."""
        for flag in FOREIGN_FLAGS.get(foreign, ()):
            action = self._option_string_actions.get(flag)
            if action is None:
                continue
            if action.nargs == 0:
                return flag
            metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            return f"{flag} {metavar}"
        return None
