"""LoRA adapters of GPT-2 as peft saves them: read, checked against the model, scale folded in.

A directory holds `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}.lora_{A|B}.weight`,
A `[r, in]` and B `[out, r]` (nn.Linear's layout even for GPT-2's Conv1D: peft's `fan_in_fan_out`
only transposes the merged product, so it changes nothing here). Any subset of layers and targets.
The delta of a target is `x @ A.T @ B.T * scale`, scale = lora_alpha / r, or lora_alpha / sqrt(r)
with rsLoRA; A is kept as `[in, r]` and B as `[r, out]` with the scale multiplied in.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model.gpt2 import GPTConfig

TARGETS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
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
    path: str, config: GPTConfig, max_rank: int
) -> tuple[int, dict[Key, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter saved at `path`, as (rank, weights); LoraError naming what is wrong if it cannot be served."""
    cfg = _read_config(Path(path))
    try:
        tensors = load_file(Path(path) / "adapter_model.safetensors")
    except (SafetensorError, OSError, ValueError) as err:  # a damaged or truncated file
        raise LoraError(f"'{path}/adapter_model.safetensors' cannot be read: {err}") from None
    pairs: dict[Key, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoraError(_unsupported_target(name))
        layer, target, half = int(match[1]), match[2], match[3]
        pairs.setdefault((layer, target), {})[half] = tensor
    if not pairs:
        raise LoraError(f"'{path}' holds no LoRA weights")
    shapes = target_shapes(config)
    weights = {}
    for (layer, target), ab in sorted(pairs.items()):
        where = f"layer {layer} {target}"
        if layer >= config.n_layer:
            raise LoraError(f"{where}: the model has {config.n_layer} layers")
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[target]
        r = a.shape[0]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise LoraError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model "
                f"(want [r, {n_in}] and [{n_out}, r]: an adapter for other dimensions)"
            )
        if r > max_rank:
            raise LoraError(f"{where}: rank {r} exceeds MAX_LORA_RANK ({max_rank})")
        scale = _alpha(cfg, f"transformer.h.{layer}.{target}") / (math.sqrt(r) if cfg.get("use_rslora") else r)
        weights[(layer, target)] = (a.float().T.contiguous(), (b.float() * scale).T.contiguous())
    return max(a.shape[1] for a, _ in weights.values()), weights


def _read_config(directory: Path) -> dict:
    if not directory.exists():
        raise LoraError(f"'{directory}' does not exist")
    config_file = directory / "adapter_config.json"
    if not directory.is_dir() or not config_file.is_file():
        raise LoraError(f"'{directory}' is not a LoRA adapter: no adapter_config.json")
    if not (directory / "adapter_model.safetensors").is_file():
        raise LoraError(f"'{directory}' has no adapter_model.safetensors (only safetensors weights are read)")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoraError(f"'{config_file}' is not valid JSON: {err}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise LoraError(f"'{config_file}' is not a LoRA adapter's config (peft_type must be 'LORA')")
    for field, what in _UNSUPPORTED.items():
        if cfg.get(field):
            raise LoraError(f"{what} ('{field}' in adapter_config.json) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"bias '{cfg['bias']}' is not supported: only 'none'")
    if not isinstance(cfg.get("lora_alpha"), int | float) or cfg["lora_alpha"] <= 0:
        raise LoraError(f"'lora_alpha' in adapter_config.json must be a positive number, got {cfg.get('lora_alpha')!r}")
    return cfg


def _alpha(cfg: dict, module: str) -> float:
    """lora_alpha, or the alpha_pattern entry that names this module (peft matches a pattern at a name's end)."""
    for pattern, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            return float(alpha)
    return float(cfg["lora_alpha"])


def _unsupported_target(tensor_name: str) -> str:
    module = re.sub(
        r"(\.base_layer)?\.(lora_\w+|weight)(\.weight)?$", "", tensor_name.removeprefix("base_model.model.")
    )
    return (
        f"target module '{module}' is not supported: only c_attn, c_proj and c_fc of the transformer "
        "blocks (not lm_head or the embeddings wte / wpe)"
    )
