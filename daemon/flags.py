"""The command line and environment of ``outrider serve``: a flag per ``ServeConfig`` field
(config.py), its help, and ``resolve``, which builds the one ``ServeConfig`` and checks it.

Every flag ``--foo-bar`` may also be set as ``OUTRIDER_FOO_BAR``; the command line wins. A
command that leaves flags out (``bench latency``) reads no ``OUTRIDER_*`` value for them. This
module is the only place that reads ``OUTRIDER_*`` serve settings; debug knobs live in
``DEBUG_KNOBS`` (plugins/debug.py, where the layer kernels read them too). The help and checks
of a room's own flags live in that room (http/flags.py, frontdoor/flags.py,
processes/placement.py) and are gathered here; the rest are checked in ``validate``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from outrider.daemon.config import (
    CHOSEN_BACKEND,
    ConfigError,
    ServeConfig,
)
from outrider.daemon.family import family_defaults
from outrider.daemon.frontdoor.flags import (
    FRONT_DOOR_HELP,
    FRONT_DOOR_METAVARS,
    FRONT_DOOR_SHOWN_DEFAULTS,
    front_door_problems,
    parse_socket_mode,
)
from outrider.daemon.http.flags import (
    HTTP_HELP,
    HTTP_METAVARS,
    HTTP_SHOWN_DEFAULTS,
    http_problems,
)
from outrider.daemon.processes.hardware import AUTO_DEVICE, resolve_device
from outrider.daemon.processes.placement import (
    PLACEMENT_HELP,
    PLACEMENT_SHOWN_DEFAULTS,
    placement_problems,
)

_FIELDS = {f.name: f for f in fields(ServeConfig)}

# Help text of every flag; ``test_cli`` checks that each field has one.
_HELP: dict[str, str] = {
    "model": (
        "model directory (Hugging Face layout, safetensors weights), or a config.json path "
        "with --load-format dummy; without it, the embedded model family with DFlash"
    ),
    "load_format": "auto: weights from the directory; dummy: random weights of the same shapes",
    "dtype": (
        "auto: float32 on CPU; on CUDA the checkpoint's half precision (bfloat16 for a float32 "
        "checkpoint or one that names none)"
    ),
    "device": "where the model runs; auto: cuda when torch sees a CUDA device, else cpu",
    "page_size": "KV page size in tokens (a power of two)",
    "max_running": "most requests decoding at once",
    "kv_cache_tokens": (
        "KV pool size in tokens; 0: from --gpu-memory-fraction on CUDA, a few contexts on CPU"
    ),
    "gpu_memory_fraction": "share of the free GPU memory the daemon may use after the weights",
    "context_length": (
        "longest prompt + output; 0: the model's maximum (lowered, and logged, when an "
        "implicit pool is smaller)"
    ),
    "generation_config": (
        "what requests that leave temperature, top_p or top_k out get: auto, the model "
        "directory's generation_config.json values (do_sample false is greedy; a value it does "
        "not give, or no file, keeps Outrider's); none, Outrider's (1.0, 1.0, 0); logged at start"
    ),
    "attention_backend": (
        "attention backend of every phase (see `outrider plugins`); auto: per phase the one "
        "measured fastest on this GPU generation that can run the configuration (torch on CPU; "
        "on Hopper fa4 for prompts, the auto plugin elsewhere), logged at start and shown by "
        "`outrider plugins --check`"
    ),
    "prefill_attention_backend": "attention backend of prompt (EXTEND) batches",
    "decode_attention_backend": (
        "attention backend of decode batches (auto here: the plugin that routes by batch size)"
    ),
    "verify_attention_backend": "attention backend of speculative verify batches",
    "draft_attention_backend": "attention backend of the draft model's batches",
    "attention_config": (
        "options of attention backend NAME, checked against its options struct (repeatable)"
    ),
    "speculative_algorithm": (
        "speculative plugin (ngram, eagle3, dflash, standalone built in; see `outrider "
        "plugins`), or none"
    ),
    "speculative_num_draft_tokens": "tokens verified per row, the root included; 0: the plugin's",
    "speculative_num_steps": "draft steps S: a chain verifies S + 1 tokens; 0: from N",
    "speculative_topk": (
        "branching per draft step; 1 (or 0) drafts a chain, K > 1 a tree (needs S and N)"
    ),
    "speculative_config": "the speculative plugin's options as JSON, checked against its struct",
    "draft_model": "draft model directory, for the plugins that need one",
    "speculative_min_acceptance": (
        "a decode batch drafts while its requests' measured acceptance length (1 + accepted "
        "drafts per cycle) reaches A, else it runs plain steps (probing now and then), and "
        "requests of a kind whose acceptance does not pay do not feed the draft; negative: the "
        "cycle's cost in plain steps, measured at start; 0: always draft"
    ),
    "speculative_simulate_acceptance": (
        "debug, for dummy weights: commit a mean of A tokens per verify (1 + accepted drafts) "
        "whatever the drafts are, each draft position accepted with one probability until the "
        "first refused; outputs are meaningless; 0: off"
    ),
    "no_overlap": "run the serial loop (the same tokens, no CPU/GPU overlap)",
    "mixed_batches": (
        "decoding rows ride prompt batches, a token each within --chunked-prefill-tokens, so "
        "that decoding never waits for a prompt (the same tokens; the riders attend as a batch "
        "of their own on the decode backend; under speculation a row that drafted in the step "
        "before sits out one prompt batch; at 256 concurrent requests it trades about 4 % of "
        "throughput for a third of the median time to first token, with longer P99 times to "
        "first token and between tokens: BENCHMARKS.md)"
    ),
    "whole_sliding_kv": (
        "the sliding-window layers keep K/V for every position, as the full layers do; off: "
        "for the positions their windows read only, in pages of their own, so that the pool "
        "holds more tokens (gpt-oss, half its layers sliding: twice as many), and a "
        "prefix-cache hit counts up to where the cache kept the window before it (the ends of "
        "published prompts and texts, and a prefix that a hit cut short computed again); no "
        "effect on a model without sliding-window layers"
    ),
    "max_prompt_run": (
        "at most N prompt (EXTEND) batches in a row while requests are part-way through "
        "decoding (a decode step taken), then a decode batch first, so that such a request "
        "waits behind N prompt batches at most (the same tokens; a request that has not "
        "decoded yet waits for the run, as a wave of new requests fills the batch); 0: "
        "prompts always first"
    ),
    "disable_cuda_graph": "run every decode batch eagerly (CUDA graphs are on by default)",
    "cuda_graph_max_bs": "the largest decode batch replayed from a CUDA graph (larger: eager)",
    "chunked_prefill_tokens": (
        "most tokens in one EXTEND batch: prompt chunks and the decoding rows riding it"
    ),
    "grammar_mask_limit_ms": (
        "a constrained request whose grammar's masks take longer than MS each, on the mean of "
        "each of three steps in a row, ends with invalid_request (such a grammar, a long "
        "bounded pattern say, would slow every step of its batch); 0: no limit"
    ),
    "grammar_compile_timeout": (
        "seconds a grammar may take to compile, in a process of its own, before its request "
        "is refused (invalid_request); 0: compile in the daemon's process, without limits"
    ),
    "grammar_compile_memory_mb": (
        "memory a grammar's compile may take (its process's data segment) before its request "
        "is refused"
    ),
    "drain_timeout": "seconds running requests may finish after SIGTERM or a first SIGINT",
    "step_timeout": "seconds a step may run before the systemd watchdog pings stop",
    "step_log": (
        "append a JSON line per loop turn to FILE (its Unix time; the step's kind, rows, "
        "tokens, width and riders; planning and waiting milliseconds; a constrained step's "
        "host mask time and waits; on CUDA, the allocator's calls to the driver where there "
        "were some): where latency goes"
    ),
    "log_level": "log level of the daemon and its children",
    "seed": "seed of --load-format dummy weights",
    **PLACEMENT_HELP,
    **FRONT_DOOR_HELP,
    **HTTP_HELP,
}

# The flags only a serving daemon uses: its client socket and access control (the front door),
# the HTTP front, the drain, the step watchdog, the sampling defaults of client requests and
# the grammars' limits.
# ``bench latency`` runs the engine in process and takes every other flag.
SERVING_ONLY: frozenset[str] = frozenset(
    {
        *FRONT_DOOR_HELP,
        *HTTP_HELP,
        "drain_timeout",
        "step_timeout",
        "generation_config",
        "grammar_mask_limit_ms",
        "grammar_compile_timeout",
        "grammar_compile_memory_mb",
    }
)

_CHOICES: dict[str, tuple[str, ...]] = {
    "load_format": ("auto", "dummy"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "device": ("auto", "cpu", "cuda"),
    "generation_config": ("auto", "none"),
    "log_level": ("debug", "info", "warning", "error"),
}

_METAVAR: dict[str, str] = {
    "model": "DIR",
    "draft_model": "DIR",
    "attention_backend": "NAME",
    "prefill_attention_backend": "NAME",
    "decode_attention_backend": "NAME",
    "verify_attention_backend": "NAME",
    "draft_attention_backend": "NAME",
    "attention_config": "NAME='{json}'",
    "speculative_algorithm": "NAME",
    "speculative_num_steps": "S",
    "speculative_topk": "K",
    "speculative_config": "'{json}'",
    "speculative_simulate_acceptance": "A",
    "speculative_min_acceptance": "A",
    "gpu_memory_fraction": "F",
    "drain_timeout": "S",
    "step_timeout": "S",
    "step_log": "FILE",
    "grammar_mask_limit_ms": "MS",
    "grammar_compile_timeout": "S",
    "grammar_compile_memory_mb": "MB",
    **FRONT_DOOR_METAVARS,
    **HTTP_METAVARS,
}

# Other spellings of a flag, given before it (``--help`` and the tests name the last one).
_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("--tp",)}

# Flags whose default is not their field's (config.py's docstring says why); ``resolve``
# applies them.
_FLAG_DEFAULTS: dict[str, str] = {"device": AUTO_DEVICE, "attention_backend": CHOSEN_BACKEND}

# Defaults whose plain value would mislead or say nothing ("", 0 with a meaning of its own).
_SHOWN_DEFAULT: dict[str, str] = {
    **_FLAG_DEFAULTS,
    "model": "the embedded family",
    "prefill_attention_backend": "--attention-backend",
    "decode_attention_backend": "--attention-backend",
    "verify_attention_backend": "--attention-backend",
    "draft_attention_backend": "--attention-backend",
    "speculative_algorithm": "none (dflash for the embedded family)",
    "speculative_config": "the plugin's defaults",
    "draft_model": "the embedded family's, for dflash and eagle3",
    "speculative_min_acceptance": "measured at start",
    **PLACEMENT_SHOWN_DEFAULTS,
    **FRONT_DOOR_SHOWN_DEFAULTS,
    **HTTP_SHOWN_DEFAULTS,
}


def env_name(field_name: str) -> str:
    return "OUTRIDER_" + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def shown_default(field_name: str) -> str:
    """The default of a serve flag as ``--help`` and the README show it."""
    if field_name in _SHOWN_DEFAULT:
        return _SHOWN_DEFAULT[field_name]
    default = _FIELDS[field_name].default
    if isinstance(default, bool):
        return "on" if default else "off"
    if default in ("", ()):
        return "none"
    return f"{default:g}" if isinstance(default, float) else str(default)


def metavar(field_name: str) -> str | None:
    """What follows the flag in usage lines; None for a switch."""
    f = _FIELDS[field_name]
    if f.type == "bool":
        return None
    if field_name in _CHOICES:
        return "|".join(_CHOICES[field_name])
    return _METAVAR.get(field_name, "N" if f.type == "int" else "X" if f.type == "float" else "V")


def add_serve_arguments(
    parser: argparse.ArgumentParser, leave_out: Collection[str] = frozenset()
) -> None:
    """One flag per ``ServeConfig`` field but those named in ``leave_out`` (which keep their
    defaults when ``resolve`` is given the same ``leave_out``); defaults are applied in
    ``resolve``."""
    for f in fields(ServeConfig):
        if f.name in leave_out:
            continue
        flag = flag_name(f.name)
        names = (*_ALIASES.get(f.name, ()), flag)
        help_text = (
            f"{_HELP[f.name]} (default: {shown_default(f.name)}) [env {env_name(f.name)}]"
        ).replace("%", "%%")
        shown = metavar(f.name)
        if f.type == "bool":
            parser.add_argument(
                *names, dest=f.name, action="store_true", default=None, help=help_text
            )
        elif f.name == "attention_config":
            parser.add_argument(
                *names, dest=f.name, action="append", default=None, metavar=shown, help=help_text
            )
        elif f.name in _CHOICES:
            parser.add_argument(
                *names, dest=f.name, default=None, choices=_CHOICES[f.name], help=help_text
            )
        else:
            parser.add_argument(*names, dest=f.name, default=None, metavar=shown, help=help_text)


def flag_table() -> str:
    """The README's table of serve flags (Markdown), from the same table as ``--help``."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in fields(ServeConfig):
        shown = metavar(f.name)
        flag = flag_name(f.name) + ("" if shown is None else f" {shown}")
        cells = (f"`{flag}`", shown_default(f.name), _HELP[f.name])
        escaped = (cell.replace("|", "\\|").replace("*", "\\*") for cell in cells)
        rows.append("| " + " | ".join(escaped) + " |")
    return "\n".join(rows) + "\n"


def _convert(name: str, type_name: str, raw: Any) -> Any:
    if raw is None:
        return None
    if type_name == "bool":
        if isinstance(raw, bool):
            return raw
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{env_name(name)}: expected a boolean, got {raw!r}")
    if name == "socket_mode":
        return parse_socket_mode(raw)
    if type_name == "int":
        return int(raw)
    if type_name == "float":
        return float(raw)
    if name == "attention_config":
        return tuple(raw) if isinstance(raw, list) else tuple(s for s in raw.split(";") if s)
    return str(raw)


def resolve(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    leave_out: Collection[str] = frozenset(),
) -> ServeConfig:
    """CLI value, else ``OUTRIDER_<FLAG>``, else the default; a field in ``leave_out`` (a flag
    the command does not offer) takes its default, whatever the environment says. ``--device
    auto`` becomes the device it picks (hardware.py); then validate once."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServeConfig):
        raw = getattr(args, f.name, None)
        if raw is None and f.name not in leave_out:
            raw = environ.get(env_name(f.name))
        if raw is None:
            raw = _FLAG_DEFAULTS.get(f.name)
        try:
            value = _convert(f.name, str(f.type), raw)
        except ValueError as exc:
            raise ConfigError(f"{flag_name(f.name)}: {exc}") from None
        if value is not None:
            if f.name in _CHOICES and value not in _CHOICES[f.name]:
                choices = ", ".join(_CHOICES[f.name])
                raise ConfigError(f"{flag_name(f.name)}: {value!r} is not one of {choices}")
            values[f.name] = value
    values["device"] = resolve_device(values["device"])
    if "model" not in values:
        defaults = family_defaults(values)
        if defaults is None:
            raise ConfigError(
                "--model is required (or OUTRIDER_MODEL): the embedded model family that "
                "serves without it is not installed (pip install ./family)"
            )
        values |= defaults
    config = ServeConfig(**values)
    problems = validate(config)
    if problems:
        raise ConfigError("; ".join(problems))
    return config


def validate(config: ServeConfig) -> list[str]:
    problems = []
    if config.page_size < 1 or config.page_size & (config.page_size - 1):
        problems.append(f"--page-size must be a power of two, not {config.page_size}")
    if config.max_running < 1:
        problems.append("--max-running must be at least 1")
    problems += placement_problems(config)
    if config.cuda_graph_max_bs < 1:
        problems.append("--cuda-graph-max-bs must be at least 1")
    if config.max_prompt_run < 0:
        problems.append("--max-prompt-run must be at least 0")
    if config.chunked_prefill_tokens < config.page_size:
        problems.append("--chunked-prefill-tokens must be at least --page-size")
    if not 0.0 < config.gpu_memory_fraction <= 1.0:
        problems.append("--gpu-memory-fraction must be in (0, 1]")
    draft_counts = (config.speculative_num_draft_tokens, config.speculative_num_steps)
    if min(*draft_counts, config.speculative_topk) < 0:
        problems.append("--speculative-num-draft-tokens, -num-steps and -topk must be >= 0")
    if config.speculative_simulate_acceptance and (
        config.speculative_simulate_acceptance < 1.0 or config.speculative_algorithm == "none"
    ):
        problems.append(
            "--speculative-simulate-acceptance must be at least 1 (or 0: off) and needs a "
            "speculative algorithm"
        )
    if config.grammar_mask_limit_ms < 0 or config.grammar_compile_timeout < 0:
        problems.append("--grammar-mask-limit-ms and --grammar-compile-timeout must be >= 0")
    if config.grammar_compile_memory_mb < 1:
        problems.append("--grammar-compile-memory-mb must be at least 1")
    if config.kv_cache_tokens < 0 or config.context_length < 0:
        problems.append("--kv-cache-tokens and --context-length must be >= 0")
    for item in config.attention_config:
        name, sep, _ = item.partition("=")
        if not sep or not name:
            problems.append(f"--attention-config {item!r}: expected NAME='{{json}}'")
    if config.device == "cpu" and config.dtype not in ("auto", "float32"):
        problems.append(f"--dtype {config.dtype} is not supported on CPU (use float32)")
    problems += front_door_problems(config)
    problems += http_problems(config)
    return problems
