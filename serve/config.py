"""The server's frozen configuration. Every field is a command-line flag: its metadata
holds the flag's help text and group, and ``serve/cli_flags.py`` builds the flags from it,
so adding a field adds its flag."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.config import DEFAULT_SEGMENT_LEN
from tokenlake.errors import InvalidArgumentError

# the names --tool-call-parser takes (serve/api/tools/parsers.py implements each, as vLLM's
# parser of that name reads tool calls)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")

DATA_PLANES = ("local", "mp", "compute", "workers")
SCHEDULER_MODES = ("elastic", "colocated")
DTYPES = ("auto", "float32", "bfloat16")
KERNEL_BACKENDS = ("cpu", "torch", "flashinfer")
MAX_TEXT_CHARS = 1 << 20  # --max-text-chars' default: a 1 Mi-character prompt, ~250k tokens
MAX_BODY_BYTES_LIMIT = 1 << 30  # a body is held in memory whole: bound what a flag can ask

MODEL, POOL, HTTP = "model", "pool and scheduler", "HTTP"


def _flag(default, help: str, group: str, choices: tuple[str, ...] | None = None):
    """A config field that is also a flag (``help`` may use ``%(default)s``)."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass(frozen=True)
class ServeConfig:
    """How ``python -m tokenlake.serve`` runs; each field's meaning is its ``help`` below
    (also shown by ``--help``)."""

    model: str = _flag(
        "tiny-random",
        "Hugging Face checkpoint directory (config.json + *.safetensors, tokenizer.json), or "
        "'tiny-random' for a seeded small Llama made locally (default: %(default)s)",
        MODEL,
    )
    served_model_name: str | None = _flag(
        None, "the name clients pass as 'model' (default: --model)", MODEL
    )
    dtype: str = _flag(
        "auto", "weights and KV dtype; auto: the checkpoint's fp32 or bf16, and fp32 for an "
        "fp16 checkpoint (its weights upcast exactly: the model computes in fp32 or bf16 "
        "only) (default: %(default)s)", MODEL, DTYPES,
    )  # fmt: skip
    num_instances: int = _flag(4, "TokenLake instances (default: %(default)s)", POOL)
    segment_len: int = _flag(
        DEFAULT_SEGMENT_LEN, "tokens per KV segment (default: %(default)s)", POOL
    )
    num_slots: int = _flag(512, "segment slots per instance (default: %(default)s)", POOL)
    host_tier_gb: float = _flag(
        0.0, "GiB of host memory below the pool: a segment evicted from a full pool waits "
        "there for its next hit (loaded back before the layers that read it) instead of being "
        "recomputed; 0 = no tier. With --data-plane local or mp (default: %(default)s)", POOL,
    )  # fmt: skip
    max_model_len: int = _flag(
        0, "longest prompt + output in tokens; 0 = the model's, capped by the pool", MODEL
    )
    chunk_len: int = _flag(
        512, "most tokens of one prefill chunk, a multiple of --segment-len "
        "(default: %(default)s)", POOL,
    )  # fmt: skip
    max_num_seqs: int = _flag(
        64, "most requests running at once; more wait in the queue (default: %(default)s)",
        POOL,
    )  # fmt: skip
    data_plane: str = _flag(
        "local", "local: engines in this process; mp: query/transfer engine processes per "
        "instance; compute: mp plus a compute process per instance, so instances compute in "
        "parallel; workers: one process per instance with its own step loop, plans and logits "
        "through shared memory, peers' segments read in place (default: %(default)s)", POOL,
        DATA_PLANES,
    )  # fmt: skip
    kernel_backend: str | None = _flag(
        None, "attention kernels (default: by device)", POOL, KERNEL_BACKENDS
    )
    host: str = _flag("127.0.0.1", "address to bind (default: %(default)s)", HTTP)
    port: int = _flag(8000, "port; 0 = any free port (default: %(default)s)", HTTP)
    seed: int = _flag(
        0, "seed of tiny-random and of unseeded sampling (default: %(default)s)", MODEL
    )
    profile: bool = _flag(
        True, "measure the scheduler's latency model at start-up (--no-profile skips it)", POOL
    )
    torch_threads: int = _flag(
        0, "threads for the model's torch ops; 0 = torch's default (default: %(default)s)", POOL
    )
    scheduler_mode: str = _flag(
        "elastic", "elastic: prefill batches of DoP 1..N; colocated: DoP 1, each instance's "
        "compute on its own (tokenlake launch always uses colocated; default: %(default)s)",
        POOL, SCHEDULER_MODES,
    )  # fmt: skip
    tbt_slo_ms: float = _flag(
        0.0, "target milliseconds between two output tokens: while decodes run, the scheduler "
        "cuts prefill chunks so that an iteration fits it, by the latency model profiled at "
        "start-up; 0 = no target (default: %(default)s)", POOL,
    )  # fmt: skip
    max_body_bytes: int = _flag(
        8 << 20, "largest HTTP request body in bytes; a larger one gets a 413 before it is "
        "read whole (default: %(default)s)", HTTP,
    )  # fmt: skip
    api_key_file: str | None = _flag(
        None, "a file holding the API key that /v1/* requests must send as 'Authorization: "
        "Bearer <key>'; a key is never taken on the command line, where other users' ps shows "
        "it, nor from an environment variable (default: no key)", HTTP,
    )  # fmt: skip
    metrics_require_key: bool = _flag(
        False, "with --api-key-file, /metrics requires the key too (/health, /ping and "
        "/version stay open; default: /metrics open, as in vLLM)", HTTP,
    )  # fmt: skip
    max_text_chars: int = _flag(
        MAX_TEXT_CHARS, "most characters of text in one request (prompts, messages, stop strings and "
        "the like, in all); more is a 400 naming the field, before any of it is tokenized "
        "(default: %(default)s)", HTTP,
    )  # fmt: skip
    shutdown_timeout: float = _flag(
        10.0, "seconds running requests get to finish after SIGTERM (new connections are "
        "refused meanwhile); then each ends with finish_reason 'abort' (default: %(default)s)",
        HTTP,
    )  # fmt: skip
    limit_concurrency: int = _flag(
        1024, "most open HTTP connections and requests at once (uvicorn's limit_concurrency): "
        "a request past it gets a 503 (default: %(default)s)", HTTP,
    )  # fmt: skip
    timeout_keep_alive: int = _flag(
        5, "seconds an idle keep-alive connection stays open (uvicorn's timeout_keep_alive; "
        "default: %(default)s)", HTTP,
    )  # fmt: skip

    latency_model_file: str | None = _flag(
        None, "a JSON file of the scheduler's latency model: read at start-up when it exists "
        "(no profiling), else written there after profiling, so later starts plan alike "
        "(default: profile at every start)", POOL,
    )  # fmt: skip
    enable_auto_tool_choice: bool = _flag(
        False, "tool_choice 'auto' (and tools without a tool_choice): the model's tool calls "
        "are read from its output by --tool-call-parser (default: off; tools then need "
        "tool_choice 'none', 'required' or a named function)", HTTP,
    )  # fmt: skip
    tool_call_parser: str | None = _flag(
        None, "how tool calls are written in the model's output, as vLLM's parser of that "
        "name reads them (needed by --enable-auto-tool-choice)", HTTP, TOOL_CALL_PARSERS,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("num_instances", "segment_len", "num_slots", "chunk_len", "max_num_seqs"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_model_len", self.max_model_len, 0)
        _check_int("torch_threads", self.torch_threads, 0)
        _check_int("max_body_bytes", self.max_body_bytes, 1, MAX_BODY_BYTES_LIMIT)
        _check_int("max_text_chars", self.max_text_chars, 1)
        _check_int("limit_concurrency", self.limit_concurrency, 1)
        _check_int("timeout_keep_alive", self.timeout_keep_alive, 1)
        grace = self.shutdown_timeout
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 3600:
            raise InvalidArgumentError(
                f"shutdown_timeout: expected seconds in [0, 3600], got {grace!r}"
            )
        tbt = self.tbt_slo_ms
        if isinstance(tbt, bool) or not isinstance(tbt, (int, float)) or not 0 <= tbt < 1e7:
            raise InvalidArgumentError(
                f"tbt_slo_ms: expected milliseconds in [0, 1e7) (0: no target), got {tbt!r}"
            )
        tier = self.host_tier_gb
        if isinstance(tier, bool) or not isinstance(tier, (int, float)) or not 0 <= tier <= 1 << 20:
            raise InvalidArgumentError(
                f"host_tier_gb: expected GiB in [0, {1 << 20}] (0: no tier), got {tier!r}"
            )
        if tier and self.data_plane not in ("local", "mp"):
            raise InvalidArgumentError(
                f"host_tier_gb: the host tier runs with --data-plane local or mp, not "
                f"{self.data_plane!r}; got {tier!r}"
            )
        if self.chunk_len % self.segment_len:
            raise InvalidArgumentError(
                f"chunk_len: expected a multiple of segment_len={self.segment_len}, "
                f"got {self.chunk_len}"
            )
        _check_choice("scheduler_mode", self.scheduler_mode, SCHEDULER_MODES)
        _check_choice("data_plane", self.data_plane, DATA_PLANES)
        _check_choice("dtype", self.dtype, DTYPES)
        if self.kernel_backend is not None:
            _check_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise InvalidArgumentError(
                "enable_auto_tool_choice: needs --tool-call-parser (one of "
                f"{', '.join(TOOL_CALL_PARSERS)})"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise InvalidArgumentError(f"port: expected 0..65535, got {self.port!r}")
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError(f"port: expected 0..65535, got {self.port!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice 'auto', or ``None`` when it is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name}: expected an int, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidArgumentError(f"{name}: expected an int {allowed}, got {value}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidArgumentError(f"{name}: expected one of {allowed}, got {value!r}")
