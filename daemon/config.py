"""The serving configuration: one frozen ``ServeConfig``, a field per ``outrider serve`` flag,
and what is derived from it (the attention backend asked of each slot, the serving dtype, what
plugins' checks see). Built only by ``flags.resolve``, which reads the command line and the
environment and checks every value: code that holds a ``ServeConfig`` holds a valid one.

Two flags default to ``auto``, resolved in two places: ``--device`` by ``flags.resolve``
(processes/hardware.py), so ``device`` is always ``cpu`` or ``cuda``; ``--attention-backend`` where
the dtype and the GPU are known (processes/attention_choice.py), so a slot left to it reads None in
``requested_attention`` and only the chosen routes reach the checks. A table built directly
(tests) keeps the reference defaults of these two fields, ``cpu`` and ``torch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from outrider.daemon.http.config import body_limit
from outrider.plugins.api import PHASES, CheckContext, Phase
from outrider.protocol.messages import DEFAULT_MAX_MESSAGE_BYTES

Device = Literal["cpu", "cuda"]
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_HALF_DTYPES = ("bfloat16", "float16")
# --attention-backend auto: every slot without a flag of its own is chosen for the hardware.
# A phase flag naming ``auto`` names the attention plugin of that name (the batch-size router).
CHOSEN_BACKEND = "auto"

# The attention flags' slots and the phases each routes.
AttentionSlot = Literal["prefill", "decode", "verify", "draft"]
SLOT_PHASES: dict[AttentionSlot, tuple[Phase, ...]] = {
    "prefill": ("extend",),
    "decode": ("decode",),
    "verify": ("verify",),
    "draft": ("draft_decode", "draft_extend"),
}


@dataclass(frozen=True)
class ServeConfig:
    model: str
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: DTypeName = "auto"
    device: Device = "cpu"  # the flag's default is auto (module docstring)
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""  # HOST:PORT of rank 0's rendezvous; "": a loopback port
    disable_peer_all_reduce: bool = False
    threads: int = 0  # 0: automatic, see processes/placement.py torch_threads
    page_size: int = 16
    max_running: int = 64
    kv_cache_tokens: int = 0  # 0: size the pool from memory (GPU) or the context length (CPU)
    gpu_memory_fraction: float = 0.85
    context_length: int = 0  # 0: the model's max_position_embeddings
    generation_config: Literal["auto", "none"] = "auto"
    listen: str = ""  # "": the default ipc socket
    attention_backend: str = "torch"  # the flag's default is auto (module docstring)
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
    mixed_batches: bool = False
    # Sliding layers keep their K/V for every position, as full layers do; off: inside their
    # windows only, in pages of their own (scheduler/window_pages.py).
    whole_sliding_kv: bool = False
    # Prompt batches in a row while requests are part-way through decoding, past which a
    # decode batch goes first (0: no limit).
    max_prompt_run: int = 0
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64  # the largest decode batch replayed from a CUDA graph
    chunked_prefill_tokens: int = 2048
    # A constrained request whose grammar's masks take longer than this ends (0: no limit).
    grammar_mask_limit_ms: float = 20.0
    # Grammars compile in a process of their own within these limits (0 s: in the daemon's).
    grammar_compile_timeout: float = 30.0
    grammar_compile_memory_mb: int = 4096
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # a 128k-token prompt is about 1 MiB
    max_inflight_per_client: int = 1024
    max_inflight: int = 4096
    drain_timeout: float = 60.0
    step_timeout: float = 120.0
    step_log: str = ""  # a file for a JSON line per loop turn (scheduler/step_log.py); "": none
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
        checkpoint's half precision (``checkpoint_dtype``), else bfloat16."""
        if self.dtype != "auto":
            return self.dtype
        if self.device == "cpu":
            return "float32"
        return checkpoint_dtype if checkpoint_dtype in _HALF_DTYPES else "bfloat16"

    def dtype_reason(self, checkpoint_dtype: str | None) -> str:
        """Why ``serving_dtype`` gives what it gives, for the start log and ``plugins --check``."""
        if self.dtype != "auto":
            return "--dtype"
        if self.device == "cpu":
            return "auto: float32 on CPU"
        if checkpoint_dtype in _HALF_DTYPES:
            return "auto: the checkpoint's"
        named = f"{checkpoint_dtype} in" if checkpoint_dtype else "no dtype in"
        return f"auto: {named} the checkpoint, bfloat16 on CUDA"

    def check_context(
        self,
        dtype: str,
        cuda_capability: tuple[int, int] | None = None,
        routes: Mapping[Phase, str] | None = None,
    ) -> CheckContext:
        """What plugins' ``check`` sees of this configuration, in the resolved ``dtype``, with
        ``routes`` (the chosen ones, processes/attention_choice.py) or else ``attention_routes``."""
        return CheckContext(
            device=self.device,
            dtype=dtype,
            page_size=self.page_size,
            overlap=self.overlap,
            attention_routes=dict(self.attention_routes if routes is None else routes),
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
    def requested_attention(self) -> dict[AttentionSlot, str | None]:
        """Backend per slot as the flags ask: a phase flag wins over ``--attention-backend``;
        None: chosen for the hardware (``--attention-backend auto``)."""
        given: dict[AttentionSlot, str] = {
            "prefill": self.prefill_attention_backend,
            "decode": self.decode_attention_backend,
            "verify": self.verify_attention_backend,
            "draft": self.draft_attention_backend,
        }
        every = None if self.attention_backend == CHOSEN_BACKEND else self.attention_backend
        return {slot: name or every for slot, name in given.items()}

    @property
    def attention_routes(self) -> dict[Phase, str]:
        """Backend per phase, for a configuration that leaves no slot to the hardware choice
        (otherwise the routes come from processes/attention_choice.py)."""
        routes: dict[Phase, str] = {}
        for slot, name in self.requested_attention.items():
            assert name is not None, f"the {slot} slot is chosen for the hardware"
            routes |= dict.fromkeys(SLOT_PHASES[slot], name)
        return {phase: routes[phase] for phase in PHASES}


class ConfigError(ValueError):
    """A serve setting that cannot be used; the message names the flag."""


# EX_CONFIG: the unit's RestartPreventExitStatus, so a bad setting does not restart-loop.
EXIT_CONFIG = 78
