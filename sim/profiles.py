"""GPU and model profiles for the simulated engine, read from sim/gpus.toml, sim/models.toml or a profile file."""

import json
import tomllib
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPUS_FILE = HERE / "gpus.toml"
MODELS_FILE = HERE / "models.toml"


class ProfileError(ValueError):
    """A SIM_GPU or SIM_MODEL that names no profile, a malformed profile, or a model that does not fit."""


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    flops: float  # peak FLOP/s
    bandwidth: float  # memory bytes/s
    memory_gib: float
    compute_efficiency: float  # reachable fraction of `flops`
    bandwidth_efficiency: float  # reachable fraction of `bandwidth`
    step_overhead_s: float  # fixed cost of every step

    def __post_init__(self) -> None:
        assert self.flops > 0 and self.bandwidth > 0 and self.memory_gib > 0 and self.step_overhead_s >= 0
        assert 0 < self.compute_efficiency <= 1 and 0 < self.bandwidth_efficiency <= 1

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


@dataclass(frozen=True, slots=True)
class ModelProfile:
    name: str
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    vocab_size: int
    context_len: int
    learned_positions: int  # rows of a learned position table; 0 with rotary embeddings
    gated_mlp: bool  # SwiGLU: gate, up and down matrices
    bias: bool
    norm: str  # "layernorm" or "rmsnorm"
    tied_embeddings: bool
    bytes_per_param: int
    kv_quantized: bool = False  # KV_CACHE_DTYPE int8 / fp8: a byte a value and a float32 scale per token and head

    def __post_init__(self) -> None:
        assert self.d_model % self.n_head == 0 and self.norm in ("layernorm", "rmsnorm")
        assert min(self.n_layer, self.d_ff, self.vocab_size, self.context_len, self.bytes_per_param) > 0

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block: attention, MLP and its two norms."""
        d, ff = self.d_model, self.d_ff
        attention = 4 * d * d + (4 * d if self.bias else 0)  # q, k, v, output projections
        mlp = (3 if self.gated_mlp else 2) * d * ff + (ff + d if self.bias else 0)
        return attention + mlp + 2 * self._norm_params

    @property
    def num_params(self) -> int:
        embeddings = (self.vocab_size + self.learned_positions) * self.d_model
        lm_head = 0 if self.tied_embeddings else self.vocab_size * self.d_model
        return self.n_layer * self.layer_params + embeddings + lm_head + self._norm_params  # + the final norm

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        if self.kv_quantized:  # as model.gpt2.GPTConfig.kv_bytes_per_token counts a quantized cache
            return 2 * self.n_layer * (self.d_model + 4 * self.n_head)
        return 2 * self.n_layer * self.d_model * self.bytes_per_param  # a key and a value per layer

    @property
    def _norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.d_model


def load_gpu(spec: str) -> GpuProfile:
    """A GPU by its name in sim/gpus.toml, or the one profile in a TOML file (as sim.profiler writes)."""
    table = _read(GPUS_FILE)
    if spec in table:
        return _build(GpuProfile, spec, table[spec])
    path = Path(spec)
    if not path.is_file():
        raise ProfileError(f"unknown GPU {spec!r}: expected one of {', '.join(table)} or a profile file")
    tables = _read(path)
    if len(tables) != 1 or not isinstance(next(iter(tables.values())), dict):
        raise ProfileError(f"{path} must hold exactly one GPU table")
    ((name, entry),) = tables.items()
    return _build(GpuProfile, name, entry)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def load_model(name: str, dtype: str = "", kv_cache_dtype: str = "auto") -> ModelProfile:
    """A model by its name in sim/models.toml; `dtype` (a DTYPE setting) overrides its bytes per parameter,
    `kv_cache_dtype` (KV_CACHE_DTYPE) other than auto makes its cache 8 bits a value."""
    table = _read(MODELS_FILE)
    if name not in table:
        raise ProfileError(f"unknown model {name!r}: expected one of {', '.join(table)}")
    model = replace(_build(ModelProfile, name, table[name]), kv_quantized=kv_cache_dtype != "auto")
    return replace(model, bytes_per_param=DTYPE_BYTES[dtype]) if dtype else model


def write_fixed_step_profile(directory: Path, step_s: float) -> Path:
    """A profile file (SIM_GPU) of a GPU so fast that every step costs `step_s` and nothing else: a server slow by
    the clock that costs no CPU, to measure or test everything around the model."""
    path = directory / "fixed-step.toml"
    path.write_text(
        "[fixed-step]\nflops = 1e18\nbandwidth = 1e18\nmemory_gib = 80\n"
        f"compute_efficiency = 1.0\nbandwidth_efficiency = 1.0\nstep_overhead_s = {step_s}\n"
    )
    return path


def write_gpu_profile(path: Path, gpu: GpuProfile, measured: dict) -> None:
    """`gpu` as a one-table TOML file in gpus.toml's schema, `measured` (numbers, strings, lists) as its subtable."""
    lines = [f"[{gpu.name}]"]
    lines += [f"{f.name} = {_toml(getattr(gpu, f.name))}" for f in fields(GpuProfile) if f.name != "name"]
    lines += ["", f"[{gpu.name}.measured]"]
    lines += [f"{key} = {_toml(value)}" for key, value in measured.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _toml(value) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    assert isinstance(value, int | float) and not isinstance(value, bool), value
    return repr(value)  # Python's float repr, inf included, is TOML


def _read(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{path} is not valid TOML: {err}") from None


def _build(cls, name: str, entry: dict):
    """`cls` from a TOML table; keys the class does not know (a profiler's measurements) are kept out."""
    wanted = [f.name for f in fields(cls) if f.name != "name"]
    missing = [f.name for f in fields(cls) if f.name in wanted and f.default is MISSING and f.name not in entry]
    if missing:
        raise ProfileError(f"profile {name!r} lacks {', '.join(missing)}")
    try:
        return cls(name=name, **{k: entry[k] for k in wanted if k in entry})
    except (AssertionError, TypeError) as err:
        raise ProfileError(f"profile {name!r} has an impossible value: {err or 'out of range'}") from None
