"""The serving configuration: one typed table of flags, resolved once, frozen.

Every ``outrider serve`` flag ``--foo-bar`` may also be set as ``OUTRIDER_FOO_BAR``; the
command line wins. This module is the only place that reads ``OUTRIDER_*`` serve settings;
debug knobs live in ``DEBUG_KNOBS`` (plugins/debug.py, where the layer kernels read them too).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from outrider.daemon.family import family_defaults
from outrider.daemon.http.config import FRAME_HEADROOM, body_limit, parse_host_port
from outrider.daemon.processes.runtime import is_loopback
from outrider.plugins.api import PHASES, CheckContext, Phase
from outrider.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES

Device = Literal["cpu", "cuda"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServeConfig:
    model: str
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: DTypeName = "auto"
    device: Device = "cpu"
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""  # HOST:PORT of rank 0's rendezvous; "": a loopback port
    threads: int = 0  # 0: automatic, see torch_threads
    page_size: int = 16
    max_running: int = 64
    kv_cache_tokens: int = 0  # 0: size the pool from memory (GPU) or the context length (CPU)
    gpu_memory_fraction: float = 0.85
    context_length: int = 0  # 0: the model's max_position_embeddings
    generation_config: Literal["auto", "none"] = "auto"
    listen: str = ""  # "": the default ipc socket
    attention_backend: str = "torch"
    prefill_attention_backend: str = ""
    decode_attention_backend: str = ""
    verify_attention_backend: str = ""
    draft_attention_backend: str = ""
    attention_config: tuple[str, ...] = ()  # NAME='{...}' options for attention backends
    speculative_algorithm: str = "none"
    speculative_num_draft_tokens: int = 0  # 0: from --speculative-num-steps or the plugin
    speculative_num_steps: int = 0
    speculative_topk: int = 0
    speculative_config: str = ""  # the plugin's options as JSON
    draft_model: str = ""
    # Acceptance length from which a decode batch drafts; < 0: measured at start; 0: always.
    speculative_min_acceptance: float = -1.0
    # Debug (benchmarks with dummy weights): force this mean acceptance length; 0: off.
    speculative_simulate_acceptance: float = 0.0
    no_overlap: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64  # the largest decode batch replayed from a CUDA graph
    chunked_prefill_tokens: int = 2048
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # a 128k-token prompt is about 1 MiB
    max_inflight_per_client: int = 1024
    max_inflight: int = 4096
    drain_timeout: float = 60.0
    step_timeout: float = 120.0
    insecure_tcp: bool = False
    curve_secret_key_file: str = ""
    curve_client_keys: str = ""  # directory of allowed client public certificates (*.key)
    socket_mode: int = 0o600  # an ipc:// client socket's file mode
    http: str = ""  # HOST:PORT of the OpenAI-compatible HTTP front; "": none
    http_allow_remote: bool = False
    api_key: str = ""  # "": the HTTP front checks no key
    http_allow_origins: str = ""  # comma-separated browser origins; "": none (CORS off)
    http_max_body_bytes: int = 0  # 0: body_limit(max_message_bytes)
    http_max_tokenize_tokens: int = 131072
    http_read_timeout: float = 30.0
    http_send_timeout: float = 30.0
    http_max_connections: int = 512
    served_model_name: str = ""  # "": the model directory's name (the family's name)
    log_level: str = "info"
    seed: int = 0  # seed of dummy weights

    @property
    def http_body_bytes(self) -> int:
        """The HTTP front's body limit: ``--http-max-body-bytes``, else the largest body whose
        client frame fits in ``--max-message-bytes``."""
        return self.http_max_body_bytes or body_limit(self.max_message_bytes)

    @property
    def http_origins(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.http_allow_origins.split(",") if o.strip())

    @property
    def overlap(self) -> bool:
        return not self.no_overlap

    def serving_dtype(self, checkpoint_dtype: str | None) -> str:
        """The dtype the model runs in: ``--dtype``; for auto, float32 on CPU and on CUDA the
        checkpoint's (``checkpoint_dtype``), else bfloat16."""
        if self.dtype != "auto":
            return self.dtype
        if self.device == "cpu":
            return "float32"
        return checkpoint_dtype if checkpoint_dtype in _DTYPE_NAMES else "bfloat16"

    def check_context(
        self, dtype: str, cuda_capability: tuple[int, int] | None = None
    ) -> CheckContext:
        """What plugins' ``check`` sees of this configuration, in the resolved ``dtype``."""
        return CheckContext(
            device=self.device,
            dtype=dtype,
            page_size=self.page_size,
            overlap=self.overlap,
            attention_routes=self.attention_routes,
            speculative_algorithm=self.speculative_algorithm,
            cuda_capability=cuda_capability,
            model=self.model,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            speculative_num_steps=self.speculative_num_steps,
            speculative_topk=self.speculative_topk,
            speculative_config=self.speculative_config,
            draft_model=self.draft_model,
            attention_config=dict(item.split("=", 1) for item in self.attention_config),
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def attention_routes(self) -> dict[Phase, str]:
        """Backend per phase: a phase flag wins over ``--attention-backend``."""
        chosen: dict[Phase, str] = {
            "extend": self.prefill_attention_backend,
            "decode": self.decode_attention_backend,
            "verify": self.verify_attention_backend,
            "draft_decode": self.draft_attention_backend,
            "draft_extend": self.draft_attention_backend,
        }
        return {phase: chosen[phase] or self.attention_backend for phase in PHASES}


_FIELDS = {f.name: f for f in fields(ServeConfig)}

# Help text of every flag; ``test_cli`` checks that each field has one.
_HELP: dict[str, str] = {
    "model": (
        "model directory (Hugging Face layout, safetensors weights), or a config.json path "
        "with --load-format dummy; without it, the embedded model family with DFlash"
    ),
    "load_format": "auto: weights from the directory; dummy: random weights of the same shapes",
    "dtype": "auto: float32 on CPU, the checkpoint's dtype on CUDA",
    "device": "where the model runs",
    "tensor_parallel_size": (
        "ranks the model is sharded over (alias --tp); it must divide the attention and KV "
        "heads, the MLP rows and the vocabulary; one process per rank, on CUDA one GPU each "
        "(local rank r takes visible device r)"
    ),
    "nnodes": "hosts the ranks are spread over, --tensor-parallel-size / --nnodes on each",
    "node_rank": (
        "this host's place among --nnodes: 0 runs the scheduler and serves clients; the "
        "others run only their ranks (start them with the same model flags)"
    ),
    "dist_init_addr": (
        "HOST:PORT where rank 0 (on node 0) listens for the other ranks to join "
        "(torch.distributed's TCP rendezvous); needed with --nnodes > 1"
    ),
    "threads": (
        "torch CPU threads of the daemon (of each rank with --tensor-parallel-size); 0: the "
        "CPUs it may use (affinity, cgroup quota) less one for the front door and "
        "detokenizer, which run one thread each, shared by this host's ranks; at least 1"
    ),
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
    "listen": (
        "client endpoint: ipc://PATH or tcp://HOST:PORT (TCP beyond loopback needs CURVE keys "
        "or --insecure-tcp)"
    ),
    "attention_backend": "attention backend of every phase (see `outrider plugins`)",
    "prefill_attention_backend": "attention backend of prompt (EXTEND) batches",
    "decode_attention_backend": "attention backend of decode batches",
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
        "whatever the drafts are; outputs are meaningless; 0: off"
    ),
    "no_overlap": "run the serial loop (the same tokens, no CPU/GPU overlap)",
    "disable_cuda_graph": "run every decode batch eagerly (CUDA graphs are on by default)",
    "cuda_graph_max_bs": "the largest decode batch replayed from a CUDA graph (larger: eager)",
    "chunked_prefill_tokens": "most prompt tokens in one EXTEND batch",
    "max_message_bytes": "largest client frame (ZMQ_MAXMSGSIZE); a larger one drops the client",
    "max_inflight_per_client": (
        "most requests one client connection may have in flight (more are refused: overloaded)"
    ),
    "max_inflight": "most requests in flight over all clients (more are refused: overloaded)",
    "drain_timeout": "seconds running requests may finish after SIGTERM or a first SIGINT",
    "step_timeout": "seconds a step may run before the systemd watchdog pings stop",
    "insecure_tcp": "allow a tcp:// bind beyond loopback without CURVE keys",
    "curve_secret_key_file": (
        "the daemon's CURVE secret certificate (zmq.auth format), the service user's, mode 0600"
    ),
    "curve_client_keys": (
        "directory of the client public certificates (NAME.key) CURVE lets in; required with "
        "the secret key"
    ),
    "socket_mode": "file mode of an ipc:// client socket, octal: at most 0660 (owner and group)",
    "http": "serve the OpenAI-compatible HTTP API there (loopback unless --http-allow-remote)",
    "http_allow_remote": "let --http bind beyond loopback",
    "api_key": (
        "with --http: every path but /health and /health/ready requires 'Authorization: "
        "Bearer KEY'; required with --http-allow-remote"
    ),
    "http_allow_origins": (
        "browser origins (scheme://host[:port], comma-separated) the HTTP API serves and "
        "answers CORS preflight for; a request from any other origin is refused"
    ),
    "http_max_body_bytes": (
        "largest HTTP request body (larger: 413, connection closed); at most the default"
    ),
    "http_max_tokenize_tokens": (
        "most token ids /tokenize answers with and /detokenize takes (more: 400)"
    ),
    "http_read_timeout": (
        "seconds an HTTP request's headers and body may take to arrive (then 408, closed)"
    ),
    "http_send_timeout": (
        "seconds an HTTP response may wait for its client to read (then the connection "
        "closes and its request is aborted)"
    ),
    "http_max_connections": "most HTTP connections at once (more: 503, closed)",
    "served_model_name": "the model name the HTTP API lists and requests may give",
    "log_level": "log level of the daemon and its children",
    "seed": "seed of --load-format dummy weights",
}

_CHOICES: dict[str, tuple[str, ...]] = {
    "load_format": ("auto", "dummy"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "device": ("cpu", "cuda"),
    "generation_config": ("auto", "none"),
    "log_level": ("debug", "info", "warning", "error"),
}

_METAVAR: dict[str, str] = {
    "model": "DIR",
    "listen": "ENDPOINT",
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
    "curve_secret_key_file": "FILE",
    "curve_client_keys": "DIR",
    "socket_mode": "MODE",
    "http": "HOST:PORT",
    "api_key": "KEY",
    "served_model_name": "NAME",
    "http_allow_origins": "ORIGINS",
    "http_read_timeout": "S",
    "http_send_timeout": "S",
}

# Other spellings of a flag, given before it (``--help`` and the tests name the last one).
_ALIASES: dict[str, tuple[str, ...]] = {"tensor_parallel_size": ("--tp",)}

# Defaults whose plain value would mislead or say nothing ("", 0 with a meaning of its own).
_SHOWN_DEFAULT: dict[str, str] = {
    "model": "the embedded family",
    "threads": "automatic",
    "listen": "the runtime socket",
    "prefill_attention_backend": "--attention-backend",
    "decode_attention_backend": "--attention-backend",
    "verify_attention_backend": "--attention-backend",
    "draft_attention_backend": "--attention-backend",
    "speculative_algorithm": "none (dflash for the embedded family)",
    "speculative_config": "the plugin's defaults",
    "draft_model": "the embedded family's, for dflash and eagle3",
    "speculative_min_acceptance": "measured at start",
    "dist_init_addr": "a free loopback port (one host)",
    "socket_mode": "0600",
    "max_message_bytes": f"{DEFAULT_MAX_MESSAGE_BYTES} ({DEFAULT_MAX_MESSAGE_BYTES // 2**20} MiB)",
    "http_max_body_bytes": f"--max-message-bytes less {FRAME_HEADROOM // 2**10} KiB",
    "served_model_name": "the model directory's name (outrider-family for the embedded family)",
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ServeConfig`` field; defaults are applied in ``resolve``."""
    for f in fields(ServeConfig):
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
        try:
            return int(raw, 8)
        except ValueError:
            raise ValueError(f"expected an octal mode such as 0660, got {raw!r}") from None
    if type_name == "int":
        return int(raw)
    if type_name == "float":
        return float(raw)
    if name == "attention_config":
        return tuple(raw) if isinstance(raw, list) else tuple(s for s in raw.split(";") if s)
    return str(raw)


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """CLI value, else ``OUTRIDER_<FLAG>``, else the default; then validate once."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(ServeConfig):
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = environ.get(env_name(f.name))
        try:
            value = _convert(f.name, str(f.type), raw)
        except ValueError as exc:
            raise ConfigError(f"{flag_name(f.name)}: {exc}") from None
        if value is not None:
            if f.name in _CHOICES and value not in _CHOICES[f.name]:
                choices = ", ".join(_CHOICES[f.name])
                raise ConfigError(f"{flag_name(f.name)}: {value!r} is not one of {choices}")
            values[f.name] = value
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
    if config.threads < 0:
        problems.append("--threads must be >= 0 (0: automatic)")
    if config.max_running < 1:
        problems.append("--max-running must be at least 1")
    problems += _placement_problems(config)
    if config.cuda_graph_max_bs < 1:
        problems.append("--cuda-graph-max-bs must be at least 1")
    if config.chunked_prefill_tokens < config.page_size:
        problems.append("--chunked-prefill-tokens must be at least --page-size")
    if not 0.0 < config.gpu_memory_fraction <= 1.0:
        problems.append("--gpu-memory-fraction must be in (0, 1]")
    if (
        min(
            config.speculative_num_draft_tokens,
            config.speculative_num_steps,
            config.speculative_topk,
        )
        < 0
    ):
        problems.append("--speculative-num-draft-tokens, -num-steps and -topk must be >= 0")
    if config.speculative_simulate_acceptance and (
        config.speculative_simulate_acceptance < 1.0 or config.speculative_algorithm == "none"
    ):
        problems.append(
            "--speculative-simulate-acceptance must be at least 1 (or 0: off) and needs a "
            "speculative algorithm"
        )
    if config.kv_cache_tokens < 0 or config.context_length < 0:
        problems.append("--kv-cache-tokens and --context-length must be >= 0")
    for item in config.attention_config:
        name, sep, _ = item.partition("=")
        if not sep or not name:
            problems.append(f"--attention-config {item!r}: expected NAME='{{json}}'")
    if config.device == "cpu" and config.dtype not in ("auto", "float32"):
        problems.append(f"--dtype {config.dtype} is not supported on CPU (use float32)")
    if config.curve_secret_key_file and not config.curve_client_keys:
        problems.append(
            "--curve-secret-key-file needs --curve-client-keys DIR (the client public "
            "certificates allowed in)"
        )
    if config.curve_client_keys and not config.curve_secret_key_file:
        problems.append("--curve-client-keys needs --curve-secret-key-file (CURVE is off)")
    problems += _http_problems(config)
    if config.listen and not config.listen.startswith(("ipc://", "tcp://")):
        problems.append(
            f"--listen {config.listen}: expected ipc://PATH or tcp://HOST:PORT (lower case)"
        )
    if config.max_message_bytes < 1024:
        problems.append("--max-message-bytes must be at least 1024")
    if config.socket_mode & ~0o660:
        problems.append(
            f"--socket-mode {config.socket_mode:04o}: only owner and group read/write bits "
            "(a subset of 0660) may be set"
        )
    return problems


_HTTP_FIELDS = ("api_key", "served_model_name", *(n for n in _FIELDS if n.startswith("http_")))


def _http_problems(config: ServeConfig) -> list[str]:
    if not config.http:
        given = [flag_name(n) for n in _HTTP_FIELDS if getattr(config, n) != _FIELDS[n].default]
        return [f"{', '.join(given)}: need --http"] if given else []
    try:
        host, _port = parse_host_port(config.http)
    except ValueError as exc:
        return [f"--http: {exc}"]
    if not config.http_allow_remote and not is_loopback(host):
        return [f"--http {config.http}: {host} is not a loopback address (--http-allow-remote)"]
    if config.http_allow_remote and not config.api_key:
        return [
            "--http-allow-remote needs --api-key: beyond loopback, anyone who reaches the port "
            "would drive the daemon"
        ]
    if config.curve_secret_key_file:
        return ["--http with CURVE keys is not supported: the HTTP front would need a client key"]
    return _http_limit_problems(config)


def _http_limit_problems(config: ServeConfig) -> list[str]:
    problems = []
    largest = body_limit(config.max_message_bytes)
    if largest < 1:
        problems.append(f"--max-message-bytes must exceed {FRAME_HEADROOM} with --http")
    elif not 0 <= config.http_max_body_bytes <= largest:
        problems.append(
            f"--http-max-body-bytes must be in [1, {largest}] (--max-message-bytes less "
            f"{FRAME_HEADROOM}), or 0 for that"
        )
    if config.http_max_tokenize_tokens < 1 or config.http_max_connections < 1:
        problems.append("--http-max-tokenize-tokens and --http-max-connections must be >= 1")
    if config.http_read_timeout <= 0 or config.http_send_timeout <= 0:
        problems.append("--http-read-timeout and --http-send-timeout must be > 0")
    for origin in config.http_origins:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest or "*" in rest:
            problems.append(
                f"--http-allow-origins {origin!r}: expected scheme://host[:port] (no path, "
                "no wildcard)"
            )
    return problems


# The children (front door, detokenizer, HTTP front) run one thread each; under load they take
# about one core between them, which the automatic --threads leaves to them.
CHILDREN_CORES = 1


def torch_threads(config: ServeConfig, cpus: int | None = None) -> int:
    """The torch intra-op threads of the daemon and of each rank process: ``--threads``, or
    for 0 the CPUs it may use (``cpus``, default ``available_cpus()``) less ``CHILDREN_CORES``,
    shared by this host's ranks, at least 1. NOTE: torch's
    own default takes every core; on a small host its threads then wait for one another at
    every operation whenever anything else runs (on 2 cores under load: first tokens after
    seconds instead of 0.1 s, a tenth of the tokens per second; README, ``--threads``)."""
    if config.threads:
        return config.threads
    free = (available_cpus() if cpus is None else cpus) - CHILDREN_CORES
    return max(1, free // ranks_per_node(config))


def _placement_problems(config: ServeConfig) -> list[str]:
    size, nodes = config.tensor_parallel_size, config.nnodes
    if size < 1:
        return ["--tensor-parallel-size must be at least 1"]
    if nodes < 1 or size % nodes:
        return [f"--nnodes {nodes} must divide --tensor-parallel-size {size}"]
    if not 0 <= config.node_rank < nodes:
        return [f"--node-rank must be in [0, {nodes}) (--nnodes {nodes}), not {config.node_rank}"]
    if nodes > 1 and not config.dist_init_addr:
        return ["--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)"]
    if config.dist_init_addr and not _is_host_port(config.dist_init_addr):
        return [f"--dist-init-addr must be HOST:PORT, not {config.dist_init_addr!r}"]
    return []


def _is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def ranks_per_node(config: ServeConfig) -> int:
    """The tensor-parallel ranks this host runs."""
    return config.tensor_parallel_size // config.nnodes


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by its cgroup (v2) CPU
    quota rounded down, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        group = next(line[3:] for line in lines if line.startswith("0::"))
        quota, period = (Path("/sys/fs/cgroup") / group.lstrip("/") / "cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, int(quota) // int(period))
    except (OSError, StopIteration, ValueError):
        pass  # no cgroup v2 or no quota: the affinity mask alone
    return max(1, cpus)


class ConfigError(ValueError):
    """A serve setting that cannot be used; the message names the flag."""


# EX_CONFIG: the unit's RestartPreventExitStatus, so a bad setting does not restart-loop.
EXIT_CONFIG = 78
