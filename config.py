"""Every setting of the server, read once from the environment and an optional `.env`, in groups by who
reads them: the engine's (`EngineSettings`: model, dtype, blocks, budgets, scheduling), the front door's
(`FrontDoorSettings`: HAProxy), the Batch API's (`BatchApiSettings`), and the server's own (`Settings`:
HTTP, admission, telemetry), which holds the other three. Each variable is a field's name in upper case."""

import ipaddress
import os
import socket
from dataclasses import dataclass, field, fields, replace

from dotenv import load_dotenv

MODES = ("nobatch", "static", "dynamic")
ATTENTION_BACKENDS = ("auto", "reference", "triton", "cpu")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's --kv-cache-dtype names
ENGINES = ("gpt2", "sim")
# gunicorn's threads beyond one per admitted request: what /health, /stats and a full queue's 503 find free.
SPARE_THREADS = 32


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """What the engine reads (generate/, model/, kvcache/, sim/): it never sees the server's settings."""

    engine: str = "gpt2"  # gpt2: the real model; sim: a cost model's step times (sim/)
    sim_model: str = "gpt2-medium"  # ENGINE=sim: a model in sim/models.toml
    sim_gpu: str = "a100-80gb"  # ENGINE=sim: a GPU in sim/gpus.toml, or a profile file from sim.profiler
    sim_num_gpus: int = 1  # ENGINE=sim: tensor-parallel GPUs; memory, FLOP/s and bandwidth scale with it
    model: str = ""  # empty: gpt2-medium from the hub, else random gpt2-medium weights
    device: str = ""  # empty: cuda if available, else cpu
    dtype: str = ""  # empty: generate.engine.default_dtype; ENGINE=sim: the simulated model's (16-bit)
    seed: int = 0  # seed of random:<name> weights
    max_batch_size: int = 256
    max_batch_tokens: int = 0  # per-step token budget; 0: 1024 on CPU, 2048 on CUDA and simulated GPUs
    chunked_prefill: bool = True  # off: a prompt is prefilled in one step, so the budget must cover a context
    kv_cache_gb: float = 0.0  # 0: kvcache.pool_size.default_budget_bytes (4 GB or half the free memory on cpu)
    kv_cache_blocks: int = 0  # > 0 overrides kv_cache_gb (tests, tiny pools)
    block_size: int = 16
    # auto: keys and values in the model's dtype; int8 (any device) or fp8 / fp8_e4m3 / fp8_e5m2 (CUDA): 8 bits a
    # value with a scale per token and head (model/attention.py, LayerKV), ~1.9x the blocks of 16 bits in as many bytes
    kv_cache_dtype: str = "auto"
    prefix_cache: bool = True
    attention_backend: str = "auto"  # auto: triton on CUDA when installed, cpu on a CPU where it builds, else reference
    cuda_graphs: str = "auto"  # auto: replay decode steps from CUDA graphs when the triton kernel runs on CUDA
    async_scheduling: str = "auto"  # auto: schedule the next decode step while one runs, wherever graphs replay them
    cpu_linear: str = "auto"  # matrix products on a CPU: auto (oneDNN in float32), onednn, aten (model/cpu_linear.py)
    quantization: str = ""  # int8: every product in int8 on a CPU, float32 around it (model/int8_linear.py); "": none
    step_log_size: int = 2048  # engine steps kept for /stats and the timeline (a ring buffer)
    constraint_compile_timeout_s: float = 10.0  # structured output: a constraint compiling longer is refused (400)
    constraint_cache_size: int = 256  # structured output: compiled constraints kept (least recently used out)
    # structured output: objects in a JSON schema that declare properties and say nothing of others admit
    # only those (as vLLM's default engines do; generate/closed_objects.py); true: the spec's open objects
    structured_open_objects: bool = False
    # structured output: tokens a constraint forces are appended with the token drawn before them and computed in
    # the next step, not drawn one step each (generate/engine.py, _jump_forward); the same tokens either way
    jump_forward: bool = True
    # Overload (docs/operations.md, "Priorities that preempt"): a request's priority level is worth this many
    # seconds of waiting (0: strict priority, which can starve); generate/priority.py
    priority_aging_s: float = 10.0
    priority_prefill_first: bool = True  # less urgent prompt chunks wait while a more urgent prompt prefills
    fair_share: bool = True  # off: first come, first served within a priority, as before
    fair_share_input_weight: float = 1.0  # a prompt token's cost to its tenant's counter
    fair_share_output_weight: float = 2.0  # a generated token's cost
    # LoRA adapters (docs/lora.md): name=path,... loaded at start; distinct adapters in one step (device slots);
    # the largest rank accepted; adapters held (loaded) at once
    lora_modules: str = ""
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int = 16

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"ENGINE must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not self.sim_model or not self.sim_gpu:
            raise ValueError("SIM_MODEL and SIM_GPU must not be empty")
        if self.sim_num_gpus < 1:
            raise ValueError(f"SIM_NUM_GPUS must be at least 1, got {self.sim_num_gpus}")
        if self.max_batch_tokens < 0:
            raise ValueError(f"MAX_BATCH_TOKENS must be at least 1 (or 0 for the default), got {self.max_batch_tokens}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"ATTENTION_BACKEND must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KV_CACHE_DTYPE must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.cuda_graphs not in ("auto", "off"):
            raise ValueError(f"CUDA_GRAPHS must be auto or off, got {self.cuda_graphs!r}")
        if self.async_scheduling not in ("auto", "off"):
            raise ValueError(f"ASYNC_SCHEDULING must be auto or off, got {self.async_scheduling!r}")
        if self.cpu_linear not in ("auto", "onednn", "aten"):
            raise ValueError(f"CPU_LINEAR must be auto, onednn or aten, got {self.cpu_linear!r}")
        if self.quantization not in ("", "int8"):
            raise ValueError(f"QUANTIZATION must be int8 or empty (none), got {self.quantization!r}")
        if self.step_log_size < 1:
            raise ValueError(f"STEP_LOG_SIZE must be at least 1, got {self.step_log_size}")
        if self.constraint_compile_timeout_s <= 0 or self.constraint_cache_size < 1:
            raise ValueError("CONSTRAINT_COMPILE_TIMEOUT_S must be positive and CONSTRAINT_CACHE_SIZE at least 1")
        if self.dtype not in ("", "float32", "float16", "bfloat16"):
            raise ValueError(f"DTYPE must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.priority_aging_s < 0:
            raise ValueError(f"PRIORITY_AGING_S must be at least 0, got {self.priority_aging_s}")
        if self.fair_share_input_weight < 0 or self.fair_share_output_weight < 0:
            raise ValueError("FAIR_SHARE_INPUT_WEIGHT and FAIR_SHARE_OUTPUT_WEIGHT must be at least 0")
        if self.block_size < 1 or self.max_batch_size < 1:
            raise ValueError("BLOCK_SIZE and MAX_BATCH_SIZE must be positive")
        if min(self.max_loras, self.max_lora_rank, self.max_cpu_loras) < 1:
            raise ValueError("MAX_LORAS, MAX_LORA_RANK and MAX_CPU_LORAS must be at least 1")

    def batch_token_budget(self, on_gpu: bool, max_context: int) -> int:
        """MAX_BATCH_TOKENS, or its default for the device: smaller on a CPU, where a step's cost grows
        with its tokens from the first one (1024: vLLM's throughput and a lower time to first token at
        half its 2048's inter-token tail, docs/benchmarks.md), large on a GPU, where a step costs about
        the same up to thousands of tokens. Unchunked, it must cover a whole context, so the default
        grows to one."""
        budget = self.max_batch_tokens or (2048 if on_gpu else 1024)
        if self.chunked_prefill:
            return budget
        if self.max_batch_tokens and budget < max_context:
            raise ValueError(
                f"MAX_BATCH_TOKENS ({budget}) must cover one full context ({max_context} tokens) "
                "when CHUNKED_PREFILL is off"
            )
        return max(budget, max_context)

    def max_running(self, on_gpu: bool, max_context: int) -> int:
        """Sequences that may run at once: each decodes a token every step, so no more than the budget holds."""
        return min(self.max_batch_size, self.batch_token_budget(on_gpu, max_context))

    @classmethod
    def from_env(cls, env_file: str | None = None, **overrides) -> "EngineSettings":
        """The engine's settings alone from the environment (for benchmarks and tools that run no server)."""
        return Settings.from_env(env_file, **overrides).engine


@dataclass(frozen=True, slots=True)
class FrontDoorSettings:
    """HAProxy in front of the replicas (deploy/): server.sh puts it there when HOST is not loopback or TLS_CERT
    is set."""

    front: str = "auto"  # auto: HAProxy in front when exposed; off: gunicorn faces the network itself
    tls_cert: str = ""  # a PEM file, certificate and key: the front door speaks HTTPS
    request_read_timeout_s: float = 30.0  # a client's request line, headers and body must all arrive by then (408)
    max_header_bytes: int = 16384  # request line and headers larger than this get a 400
    queue_timeout_s: float = 10.0  # a request waiting for a free replica thread longer than this gets a 503
    limit_connections: int = 256  # per client, connections open at once (an exposed front; 0: no limit)
    limit_requests: int = 200  # per client, requests in LIMIT_PERIOD_S (an exposed front; 0: no limit)
    limit_period_s: int = 10  # the request rate's window, and the 429's Retry-After
    limit_by: str = "address"  # address: a client is its IP address; key: its Authorization header, if it sends one

    def __post_init__(self) -> None:
        if self.front not in ("auto", "off"):
            raise ValueError(f"FRONT must be auto or off, got {self.front!r}")
        if self.front == "off" and self.tls_cert:
            raise ValueError("TLS_CERT needs the front door (HAProxy terminates TLS): unset FRONT=off")
        if self.limit_by not in ("address", "key"):
            raise ValueError(f"LIMIT_BY must be address or key, got {self.limit_by!r}")
        if min(self.limit_connections, self.limit_requests) < 0 or self.limit_period_s < 1:
            raise ValueError("LIMIT_CONNECTIONS and LIMIT_REQUESTS must be at least 0, LIMIT_PERIOD_S at least 1")
        if self.request_read_timeout_s <= 0 or self.queue_timeout_s <= 0 or self.max_header_bytes < 1024:
            raise ValueError("REQUEST_READ_TIMEOUT_S and QUEUE_TIMEOUT_S must be positive, MAX_HEADER_BYTES >= 1024")


@dataclass(frozen=True, slots=True)
class BatchApiSettings:
    """The Batch API's files and limits (batching/batch_jobs.py)."""

    data_dir: str = "data"  # the Batch API's files and batches (they survive a restart there)
    batch_max_file_bytes: int = 8 << 20  # an uploaded batch file
    batch_max_requests: int = 10_000  # lines of one batch file
    batch_in_flight: int = 32  # the Batch API's requests in the server at once, shared fairly between tenants
    # Each tenant's share of DATA_DIR: the bytes of its files (uploads and batch outputs), and its batches not yet
    # ended; past either, an upload or a new batch is refused with 429 (0: no limit)
    batch_tenant_max_bytes: int = 256 << 20
    batch_tenant_max_batches: int = 16
    batch_retention_s: float = 30 * 24 * 3600.0  # files and ended batches are removed this long after (0: kept)
    batch_max_retries: int = 6  # a line refused for load (429, 503, 504) is tried again this often, backing off

    def __post_init__(self) -> None:
        if self.batch_max_file_bytes < 1 or self.batch_max_requests < 1 or self.batch_in_flight < 1:
            raise ValueError("BATCH_MAX_FILE_BYTES, BATCH_MAX_REQUESTS and BATCH_IN_FLIGHT must be positive")
        if min(self.batch_tenant_max_bytes, self.batch_tenant_max_batches, self.batch_max_retries) < 0:
            raise ValueError("BATCH_TENANT_MAX_BYTES, BATCH_TENANT_MAX_BATCHES and BATCH_MAX_RETRIES must be >= 0")
        if not 0 <= self.batch_retention_s < float("inf"):
            raise ValueError(f"BATCH_RETENTION_S must be seconds >= 0 (0: kept), got {self.batch_retention_s}")


@dataclass(frozen=True, slots=True)
class Settings:
    """The server's own settings (HTTP, admission, telemetry), holding the engine's, the front door's and the
    Batch API's."""

    mode: str = "dynamic"
    host: str = "127.0.0.1"
    port: int = 8500
    max_waiting: int = 1024
    static_batch_wait_s: float = 0.05  # how long static mode gathers a batch
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1 << 20
    api_key: str = ""  # when set, every endpoint but /health and the dashboard page needs "Authorization: Bearer <key>"
    shutdown_grace_s: float = 20.0  # on SIGTERM, how long running requests may take to finish
    chat_template: str = ""  # /v1/chat/completions: a template file (api/chat_template.toml's shape); empty: that one
    replica_name: str = ""  # empty: host:port; names this server in every response's X-Replica header
    request_event_log_size: int = 4096  # request events kept for the timeline (a ring buffer)
    timeline_window_s: float = 30.0  # /stats "window", /stats/timeline, the page: latency and tokens/s over it
    # How long a thread holding the GIL keeps it from one that waits (sys.setswitchinterval): the engine's loop
    # takes the GIL back after every device copy and wait, while request threads stream tokens; 0: Python's 5 ms
    switch_interval_ms: float = 0.0
    # Streaming: tokens per streamed event after the first, as vLLM's --stream-interval (a request's own
    # `stream_interval` may raise it); more per event wakes fewer request threads, so less Python per step
    stream_interval: int = 1
    # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, on by default as there: the engine (model, KV cache, scheduler, the
    # loop) in a process of its own (batching/engine_process.py), so no request thread's Python competes with its
    # steps; "off": one process, the engine's loop a thread of the gunicorn worker
    engine_process: str = "on"
    # vLLM's --api-server-count: gunicorn workers (front ends: HTTP, tokenizing, rendering, streams), all on one
    # engine process that the gunicorn master starts (batching/engine_process.py's EngineKeeper); 1: one worker
    api_server_count: int = 1
    engine_stall_s: float = 30.0  # /health is 503 when work waits and no step finished for this long
    engine_first_step_s: float = 300.0  # ... the limit until the first step has finished (compiles, graphs)
    max_waiting_tokens: int = 0  # prompt tokens waiting (to compute) beyond which a request is refused; 0: no bound
    ttft_target_s: float = 0.0  # refuse (429) a request that could not start within this; 0: off
    api_keys_file: str = ""  # keys (sha256-hashed or plain), each with its tenant, weight and limits (TOML or JSON)
    admin_api_key: str = ""  # the operator's key, beside the keys file's `admin = true` tenants (docs/operations.md)
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter exist (for the
    # operator only), loading adapters from directories under LORA_ROOT alone
    allow_runtime_lora_updating: bool = False
    lora_root: str = ""
    fault_hang_at_step: int = 0  # fault injection for tests: the engine step with this number hangs; 0: off
    fault_fail_marker: str = ""  # fault injection for tests: a prompt with this text fails in its first step; "": off
    engine: EngineSettings = field(default_factory=EngineSettings)
    front_door: FrontDoorSettings = field(default_factory=FrontDoorSettings)
    batch_api: BatchApiSettings = field(default_factory=BatchApiSettings)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MODE must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.request_event_log_size < 1 or self.timeline_window_s <= 0:
            raise ValueError("REQUEST_EVENT_LOG_SIZE must be at least 1 and TIMELINE_WINDOW_S positive")
        if self.engine_stall_s <= 0 or self.engine_first_step_s <= 0:
            raise ValueError("ENGINE_STALL_S and ENGINE_FIRST_STEP_S must be positive")
        if self.max_waiting_tokens < 0 or self.ttft_target_s < 0:
            raise ValueError("MAX_WAITING_TOKENS and TTFT_TARGET_S must be at least 0 (0: off)")
        if self.switch_interval_ms < 0:
            raise ValueError(f"SWITCH_INTERVAL_MS must be at least 0 (0: Python's), got {self.switch_interval_ms}")
        if self.engine_process not in ("on", "off"):
            raise ValueError(f"ENGINE_PROCESS must be on or off, got {self.engine_process!r}")
        if self.api_server_count < 1:
            raise ValueError(f"API_SERVER_COUNT must be at least 1, got {self.api_server_count}")
        if self.api_server_count > 1 and self.engine_process != "on":
            raise ValueError("API_SERVER_COUNT above 1 needs ENGINE_PROCESS=on: its front ends share one engine")
        if self.stream_interval < 1:
            raise ValueError(f"STREAM_INTERVAL must be at least 1, got {self.stream_interval}")
        if self.front_door.limit_by == "key" and not self.keyed:
            raise ValueError(
                "LIMIT_BY=key counts requests by their API key: set API_KEY, API_KEYS_FILE or ADMIN_API_KEY"
            )
        if self.allow_runtime_lora_updating and not self.lora_root:
            raise ValueError("ALLOW_RUNTIME_LORA_UPDATING needs LORA_ROOT: the directory adapters may be loaded from")
        if self.lora_root and not os.path.isdir(self.lora_root):
            raise ValueError(f"LORA_ROOT must be a directory, got {self.lora_root!r}")

    @property
    def keyed(self) -> bool:
        """Whether requests need an API key (any of API_KEY, API_KEYS_FILE, ADMIN_API_KEY)."""
        return bool(self.api_key or self.api_keys_file or self.admin_api_key)

    @property
    def replica(self) -> str:
        """This server's name behind a load balancer: REPLICA_NAME, else host:port."""
        if self.replica_name:
            return self.replica_name
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host  # a wildcard names no one
        return f"{host}:{self.port}"

    @property
    def server_threads(self) -> int:
        """gunicorn's threads: one for each request the server admits (running and waiting), and spares."""
        return max(256, self.engine.max_batch_size + self.max_waiting + SPARE_THREADS)

    @property
    def exposed(self) -> bool:
        """Listening beyond this machine: HOST is not a loopback address (a name but localhost counts as exposed)."""
        if self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return True

    @property
    def no_front_warning(self) -> str:
        return (
            f"HOST={self.host}: gunicorn faces the network without HAProxy in front (FRONT=off, or haproxy "
            f"not installed): each slow client holds one of its {self.server_threads} threads while it trickles "
            "headers, and that many of them stop the server; no per-client limits, no TLS. "
            "apt-get install haproxy, and ./server.sh puts it in front"
        )

    def exposure_warnings(self, front: bool) -> list[str]:
        """What to say at start about listening on HOST, with the front door in front (front) or not."""
        if not self.exposed:
            return []
        warnings = [] if front else [self.no_front_warning]
        if not self.keyed:
            warnings.append(f"HOST={self.host} and no API_KEY: anyone who reaches this port can generate")
        if self.allow_runtime_lora_updating and not (self.api_keys_file or self.admin_api_key):
            warnings.append(
                f"HOST={self.host} with ALLOW_RUNTIME_LORA_UPDATING and no operator (ADMIN_API_KEY, or an admin "
                "tenant in API_KEYS_FILE): every client may load and unload adapters"
            )
        return warnings

    def redacted(self) -> "Settings":  # these settings, safe to log
        hidden = lambda key: "***" if key else ""  # noqa: E731
        return replace(self, api_key=hidden(self.api_key), admin_api_key=hidden(self.admin_api_key))

    @classmethod
    def of(cls, **values) -> "Settings":
        """Settings from fields of any group by name (as the environment gives them), each to its group."""
        groups = {name: {} for name in GROUPS}
        for key, value in values.items():
            group = next((g for g, kind in GROUPS.items() if key in {f.name for f in _own(kind)}), None)
            if group is None:
                raise TypeError(f"no setting named {key!r}")
            groups[group][key] = value
        server = groups.pop("")
        return cls(**server, **{g: GROUPS[g](**v) for g, v in groups.items()})

    @classmethod
    def from_env(cls, env_file: str | None = None, **overrides) -> "Settings":
        """Settings from `NAME` variables (upper-case field names), `.env` filling gaps."""
        load_dotenv(env_file or ".env", override=False)
        values = {}
        for name, kind in setting_fields().items():
            raw = os.environ.get(name.upper())
            if raw is not None and raw != "":
                values[name] = _parse(raw, kind, name)
        values.update(overrides)
        return cls.of(**values)


# Each group's attribute on Settings ("": Settings' own fields).
GROUPS: dict[str, type] = {
    "": Settings,
    "engine": EngineSettings,
    "front_door": FrontDoorSettings,
    "batch_api": BatchApiSettings,
}


def _own(kind: type) -> list:
    """A group's own fields: Settings' without the groups it holds."""
    return [f for f in fields(kind) if not (kind is Settings and f.name in GROUPS)]


def setting_fields() -> dict[str, type]:
    """Every setting's field name and type, over all groups: its variable is the name in upper case."""
    return {f.name: type(f.default) for kind in GROUPS.values() for f in _own(kind)}


def _parse(raw: str, kind: type, name: str):
    if kind is bool:
        if raw.lower() in ("1", "true", "on", "yes", "0", "false", "off", "no"):
            return raw.lower() in ("1", "true", "on", "yes")
        raise ValueError(f"{name.upper()} must be on or off, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name.upper()} must be a {kind.__name__}, got {raw!r}") from None
