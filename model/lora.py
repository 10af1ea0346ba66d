"""LoRA adapters of GPT-2 as peft saves them: read, checked against the model, scale folded in.

A directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}.lora_{A|B}.weight`,
A `[r, in]` and B `[out, r]` (nn.Linear's layout even for GPT-2's Conv1D: peft's `fan_in_fan_out`
only transposes the merged product, so it changes nothing here). Any subset of layers and targets.
The delta of a target is `x @ A.T @ B.T * scale`, scale = lora_alpha / r, or lora_alpha / sqrt(r)
with rsLoRA; A is kept as `[in, r]` and B as `[r, out]` with the scale multiplied in.

Nothing is read before it is checked: the directory and both files are resolved (symlinks included) and,
given a root (LORA_ROOT, for loads while serving), must lie under it; every way of failing that gets the
same words, which tell nothing of what exists. Each file's size is checked before it is read (the
weights against the most an adapter within MAX_LORA_RANK of this model can hold); alphas and weights
must be finite, and within float16's range once scaled, so that no adapter can turn a row's logits to NaN.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from model.gpt2 import GPTConfig

TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
FILES = ("adapter_config.json", "adapter_model.safetensors")
NOT_LOADED = "cannot load adapter"  # how every refusal begins
MAX_CONFIG_BYTES = 64 << 10
HEADER_BYTES = 1 << 20  # room for the weights file's header (names, shapes, offsets) beside its tensors
FLOAT16_MAX = 65504.0  # the largest scaled weight taken: every device dtype holds it
_MODULE_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # an alpha_pattern key: a module name, no regex
Key = tuple[int, str]  # (layer, target)
_TENSOR = re.compile(
    r"^base_model\.model\.transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.lora_([AB])\.weight$"
)
# peft features that change what the adapter computes beyond x @ A @ B * scale: refused, never ignored
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (fully trained copies of modules)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
}


class LoraError(ValueError):
    """An adapter this server cannot serve; the message says what is wrong with it."""


@dataclass(eq=False)
class LoraAdapter:
    name: str
    path: str
    id: int  # unique for each load: keys device slots and prefix-cache blocks (a name may come back with new weights)
    rank: int  # the largest of its targets'
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]  # A [in, r], B [r, out] (scaled), float32 on the CPU
    in_flight: int = 0  # requests accepted and not yet answered (generate/lora_registry.py)


def target_shapes(config: GPTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target."""
    c = config.n_embd
    return {"attn.c_attn": (c, 3 * c), "attn.c_proj": (c, c), "mlp.c_fc": (c, 4 * c), "mlp.c_proj": (4 * c, c)}


def read_adapter(
    path: str, config: GPTConfig, max_rank: int, root: str | None = None
) -> tuple[int, dict[Key, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter saved at `path` (under `root`, if given; a relative path is taken from there), as (rank,
    weights); LoraError, beginning "cannot load adapter", naming what is wrong if it cannot be served. The
    weights file's header (names and shapes) is checked before its tensors are read."""
    config_file, weights_file = _adapter_files(path, root)
    cfg = _read_config(config_file)
    ranks = _check_shapes(_tensor_shapes(weights_file), config, max_rank)
    largest = max_weights_bytes(config, max_rank)
    if weights_file.stat().st_size > largest:
        raise LoraError(f"{NOT_LOADED}: {FILES[1]} is larger than any adapter within MAX_LORA_RANK ({largest} bytes)")
    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as err:  # a damaged or truncated file
        raise LoraError(f"{NOT_LOADED}: {FILES[1]} cannot be read: {err}") from None
    weights = {}
    for (layer, target), r in ranks.items():
        module = f"transformer.h.{layer}.{target}"
        a, b = (tensors[f"base_model.model.{module}.lora_{half}.weight"] for half in "AB")
        scale = _alpha(cfg, module) / (math.sqrt(r) if cfg.get("use_rslora") else r)
        pair = (a.float().T.contiguous(), (b.float() * scale).T.contiguous())
        if not all(w.isfinite().all() and w.abs().max() <= FLOAT16_MAX for w in pair):
            raise LoraError(f"{NOT_LOADED}: layer {layer} {target}: its weights must be finite (in float16's range)")
        weights[(layer, target)] = pair
    return max(ranks.values()), weights


def _tensor_shapes(weights_file: Path) -> dict[str, tuple[int, ...]]:
    """The weights file's tensors' names and shapes, from its header alone (at most HEADER_BYTES of it)."""
    try:
        with weights_file.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
        if header_bytes > HEADER_BYTES:
            raise LoraError(f"{NOT_LOADED}: {FILES[1]}'s header is larger than {HEADER_BYTES} bytes")
        with safe_open(weights_file, "pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - no iterator
    except (SafetensorError, OSError, ValueError) as err:  # a damaged or truncated file
        raise LoraError(f"{NOT_LOADED}: {FILES[1]} cannot be read: {err}") from None


def _check_shapes(shapes: dict[str, tuple[int, ...]], config: GPTConfig, max_rank: int) -> dict[Key, int]:
    """Each (layer, target)'s rank, once every tensor is known to be a LoRA half of this model's targets, in
    pairs whose shapes fit the model, within `max_rank`."""
    pairs: dict[Key, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoraError(_unsupported_target(name))
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = shape
    if not pairs:
        raise LoraError(f"{NOT_LOADED}: it holds no LoRA weights")
    ranks, fits = {}, target_shapes(config)
    for (layer, target), ab in sorted(pairs.items()):
        where = f"{NOT_LOADED}: layer {layer} {target}"
        if layer >= config.n_layer:
            raise LoraError(f"{where}: the model has {config.n_layer} layers")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: lora_A and lora_B must both be present")
        (n_in, n_out), r = fits[target], ab["A"][0] if ab["A"] else 0
        if ab["A"] != (r, n_in) or ab["B"] != (n_out, r):
            raise LoraError(
                f"{where}: lora_A {ab['A']} and lora_B {ab['B']} do not fit this model "
                f"(want [r, {n_in}] and [{n_out}, r]: an adapter for other dimensions)"
            )
        if r > max_rank:
            raise LoraError(f"{where}: rank {r} exceeds MAX_LORA_RANK ({max_rank})")
        if r < 1:
            raise LoraError(f"{where}: its rank must be at least 1")
        ranks[(layer, target)] = r
    return ranks


def _adapter_files(path: str, root: str | None) -> tuple[Path, Path]:
    """The adapter's config and weights files, resolved: regular files, under `root` if given. One message
    for every way they are not, so that a refusal tells nothing of what exists where."""
    where = " under LORA_ROOT" if root else ""
    refused = LoraError(f"{NOT_LOADED} {path!r}: it must be a directory{where} holding {FILES[0]} and {FILES[1]}")
    try:
        base = Path(root).resolve(strict=True) if root else None
        directory = (base / path if base else Path(path)).resolve(strict=True)
        files = [(directory / name).resolve(strict=True) for name in FILES]
    except (OSError, RuntimeError):  # missing, unreadable, or a symlink loop
        raise refused from None
    inside = base is None or all(p.is_relative_to(base) for p in (directory, *files))
    if not inside or not all(f.is_file() for f in files):
        raise refused
    return files[0], files[1]


def max_weights_bytes(config: GPTConfig, max_rank: int) -> int:
    """The largest weights file an adapter of this model within `max_rank` can need: every target of every
    layer at that rank in float32, and its header."""
    per_layer = sum(n_in + n_out for n_in, n_out in target_shapes(config).values())
    return config.n_layer * per_layer * max_rank * 4 + HEADER_BYTES


def _read_config(config_file: Path) -> dict:
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraError(f"{NOT_LOADED}: {FILES[0]} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoraError(f"{NOT_LOADED}: {FILES[0]} is not valid JSON: {err}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise LoraError(f"{NOT_LOADED}: {FILES[0]} is not a LoRA adapter's config (peft_type must be 'LORA')")
    for field, what in _UNSUPPORTED.items():
        if cfg.get(field):
            raise LoraError(f"{NOT_LOADED}: {what} ('{field}' in {FILES[0]}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{NOT_LOADED}: a 'bias' other than 'none' is not supported")
    if not _positive(cfg.get("lora_alpha")):
        raise LoraError(f"{NOT_LOADED}: 'lora_alpha' in {FILES[0]} must be a positive finite number")
    names = cfg.get("alpha_pattern") or {}
    if not isinstance(names, dict) or not all(_MODULE_NAME.fullmatch(k) and _positive(a) for k, a in names.items()):
        raise LoraError(
            f"{NOT_LOADED}: 'alpha_pattern' in {FILES[0]} must map module names (such as 'c_fc' or "
            "'h.1.mlp.c_fc'; not regular expressions) to positive finite numbers"
        )
    return cfg


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _alpha(cfg: dict, module: str) -> float:
    """lora_alpha, or the alpha_pattern entry that names this module or a dotted tail of its name (as peft
    matches a pattern at a name's end; the keys are matched as names, never compiled)."""
    for name, alpha in (cfg.get("alpha_pattern") or {}).items():
        if module == name or module.endswith("." + name):
            return float(alpha)
    return float(cfg["lora_alpha"])


def _unsupported_target(tensor_name: str) -> str:
    module = re.sub(
        r"(\.base_layer)?\.(lora_\w+|weight)(\.weight)?$", "", tensor_name.removeprefix("base_model.model.")
    )
    return (
        f"{NOT_LOADED}: target module '{module[:200]}' is not supported: only c_attn, c_proj and c_fc of the "
        "transformer blocks (not lm_head or the embeddings wte / wpe)"
    )
