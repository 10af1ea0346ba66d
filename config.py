"""Every setting of the server, read once from the environment and an optional `.env`."""

import os
import socket
from dataclasses import dataclass, fields, replace

from dotenv import load_dotenv

MODES = ("nobatch", "static", "dynamic")
ENGINES = ("gpt2", "sim")


@dataclass(frozen=True, slots=True)
class Settings:
    mode: str = "dynamic"
    engine: str = "gpt2"  # gpt2: the real model; sim: a cost model's step times (sim/)
    sim_model: str = "gpt2-medium"  # ENGINE=sim: a model in sim/models.toml
    sim_gpu: str = "a100-80gb"  # ENGINE=sim: a GPU in sim/gpus.toml, or a profile file from sim.profiler
    sim_num_gpus: int = 1  # ENGINE=sim: tensor-parallel GPUs; memory, FLOP/s and bandwidth scale with it
    model: str = ""  # empty: gpt2-medium from the hub, else random gpt2-medium weights
    host: str = "127.0.0.1"
    port: int = 8500
    device: str = ""  # empty: cuda if available, else cpu
    dtype: str = ""  # empty: float16 on cuda, float32 on cpu; ENGINE=sim: the simulated model's (16-bit)
    max_batch_size: int = 256
    max_batch_tokens: int = 2048  # tokens computed per step; must cover one full context
    kv_cache_gb: float = 0.0  # 0: 4 GB on cpu, 90% of free memory on cuda
    kv_cache_blocks: int = 0  # > 0 overrides kv_cache_gb (tests, tiny pools)
    block_size: int = 16
    prefix_cache: bool = True
    max_waiting: int = 1024
    static_batch_wait_s: float = 0.05  # how long static mode gathers a batch
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1 << 20
    seed: int = 0  # seed of random:<name> weights
    api_key: str = ""  # when set, every endpoint but /health needs "Authorization: Bearer <key>"
    shutdown_grace_s: float = 20.0  # on SIGTERM, how long running requests may take to finish
    replica_name: str = ""  # empty: host:port; names this server in every response's X-Replica header

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"MODE must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"ENGINE must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not self.sim_model or not self.sim_gpu:
            raise ValueError("SIM_MODEL and SIM_GPU must not be empty")
        if self.sim_num_gpus < 1:
            raise ValueError(f"SIM_NUM_GPUS must be at least 1, got {self.sim_num_gpus}")
        if self.max_batch_tokens < 1024:
            raise ValueError("MAX_BATCH_TOKENS must be at least 1024 (one full context)")
        if self.dtype not in ("", "float32", "float16", "bfloat16"):
            raise ValueError(f"DTYPE must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.block_size < 1 or self.max_batch_size < 1:
            raise ValueError("BLOCK_SIZE and MAX_BATCH_SIZE must be positive")

    @property
    def replica(self) -> str:
        """This server's name behind a load balancer: REPLICA_NAME, else host:port."""
        if self.replica_name:
            return self.replica_name
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host  # a wildcard names no one
        return f"{host}:{self.port}"

    def redacted(self) -> "Settings":
        """These settings, safe to log."""
        return replace(self, api_key="***" if self.api_key else "")

    @classmethod
    def from_env(cls, env_file: str | None = None, **overrides) -> "Settings":
        """Settings from `NAME` variables (upper-case field names), `.env` filling gaps."""
        load_dotenv(env_file or ".env", override=False)
        values = {}
        for f in fields(cls):
            raw = os.environ.get(f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(raw, type(f.default), f.name)
        values.update(overrides)
        return cls(**values)


def _parse(raw: str, kind: type, name: str):
    if kind is bool:
        if raw.lower() in ("1", "true", "on", "yes"):
            return True
        if raw.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{name.upper()} must be on or off, got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name.upper()} must be a {kind.__name__}, got {raw!r}") from None
