"""``outrider``: serve, generate, plugins, bench.

``generate`` and ``plugins`` work in a light install (client only); ``serve`` and ``bench``
need the ``daemon`` extra and say so.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from outrider.daemon.bench.command import add_bench_arguments, run_bench
from outrider.daemon.cli.foreign_flags import CommandParser
from outrider.daemon.cli.generate import add_generate_arguments, run_generate
from outrider.daemon.cli.plugins import add_plugins_arguments, run_plugins
from outrider.daemon.config import EXIT_CONFIG, ConfigError
from outrider.daemon.flags import add_serve_arguments, flag_table, resolve
from outrider.daemon.processes.logs import configure_logging
from outrider.daemon.version import installed_version
from outrider.protocol.messages import PROTOCOL_MINOR, PROTOCOL_VERSION

_DAEMON_EXTRA = ("torch", "transformers", "safetensors", "uvloop")

SERVE_DESCRIPTION = (
    "Run the daemon. Without --model it serves the embedded model family (a tiny Qwen3 target, "
    "pip install ./family) with DFlash speculation. Every flag --foo-bar may also be set as "
    "OUTRIDER_FOO_BAR in the environment; the command line wins. The first SIGTERM or SIGINT "
    "drains (running requests finish, up to --drain-timeout); a second SIGINT stops at once."
)


class _PrintFlagTable(argparse.Action):
    """``--help-markdown``: print the README's flag table and exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS)
        self.help = "print the flags as the README's Markdown table and exit"

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        print(flag_table(), end="")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outrider", description="An LLM inference daemon built around speculative decoding."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=(
            f"outrider {installed_version()} (client protocol {PROTOCOL_VERSION}.{PROTOCOL_MINOR})"
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    serve = commands.add_parser("serve", help="run the daemon", description=SERVE_DESCRIPTION)
    add_serve_arguments(serve)
    serve.add_argument("--help-markdown", action=_PrintFlagTable)
    add_generate_arguments(
        commands.add_parser(
            "generate", help="send one request", description="Send one request to a daemon."
        )
    )
    add_plugins_arguments(commands.add_parser("plugins", help="list the discovered plugins"))
    add_bench_arguments(commands.add_parser("bench", help="measure the engine in process"))
    return parser


def _missing_daemon_extra(command: str) -> bool:
    missing = [name for name in _DAEMON_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"outrider {command} needs the daemon extra ({', '.join(missing)} missing): "
            "pip install 'outrider[daemon]'",
            file=sys.stderr,
        )
    return bool(missing)


def _serve(args: argparse.Namespace) -> int:
    if _missing_daemon_extra("serve"):
        return 2
    try:
        config = resolve(args)
    except ConfigError as exc:
        print(f"outrider serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    from outrider.daemon.processes.start import main

    return main(config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "bench":
        if _missing_daemon_extra("bench"):
            return 2
        configure_logging("warning", "%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_bench(args)
    return run_plugins(args)
