"""Resolve the MODEL setting to GPT-2 weights: a hub name, a local directory, or random:<name>."""

import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from model.gpt2 import GPT, PRESETS, GPTConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gpt2-medium"
HUB_ORG = "openai-community"
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


class ModelLoadError(Exception):
    """The MODEL setting names something that cannot be loaded; the message says why."""


class LoadedModel(NamedTuple):
    model: GPT
    name: str  # what the API reports, e.g. "gpt2-medium" or "random:gpt2-medium"
    is_random: bool


class ModelSource(NamedTuple):
    name: str
    directory: Path | None  # a Hugging Face format checkpoint, or None for random weights
    preset: str | None  # the architecture of random weights

    def config(self) -> GPTConfig:
        """The architecture, read without loading a weight."""
        return read_config(self.directory) if self.directory is not None else PRESETS[self.preset]


def resolve_model(spec: str) -> ModelSource:
    """Where the weights for `spec` come from, downloading hub checkpoints once; no weights load.

    An empty spec means gpt2-medium, falling back loudly to random weights offline.
    """
    if not spec:
        try:
            return _from_hub(DEFAULT_MODEL)
        except ModelLoadError as err:
            for line in (
                "=" * 72,
                f"MODEL is unset and {DEFAULT_MODEL} could not be loaded: {err}",
                f"SERVING RANDOM {DEFAULT_MODEL.upper()} WEIGHTS: the output is gibberish.",
                "Set MODEL to a checkpoint directory or a hub name for real text.",
                "=" * 72,
            ):
                log.warning(line)
            return ModelSource(f"random:{DEFAULT_MODEL}", None, DEFAULT_MODEL)
    if spec.startswith("random:"):
        preset = spec.removeprefix("random:")
        if preset not in PRESETS:
            raise ModelLoadError(f"unknown model {spec!r}: expected random:<one of {', '.join(PRESETS)}>")
        return ModelSource(spec, None, preset)
    if Path(spec).is_dir():
        read_config(Path(spec))  # fail now, not in the worker, if it is not GPT-2
        return ModelSource(Path(spec).resolve().name, Path(spec), None)
    if spec.removeprefix(f"{HUB_ORG}/") in PRESETS:
        return _from_hub(spec.removeprefix(f"{HUB_ORG}/"))
    raise ModelLoadError(
        f"unknown model {spec!r}: expected one of {', '.join(PRESETS)}, "
        "a local directory with config.json, or random:<name>"
    )


def load_model(spec: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    source = resolve_model(spec)
    if source.directory is not None:
        return LoadedModel(load_checkpoint_dir(source.directory, device, dtype), source.name, is_random=False)
    model = GPT(PRESETS[source.preset])
    model.init_random(seed)
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), source.name, is_random=True)


def _from_hub(name: str) -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    repo, files = f"{HUB_ORG}/{name}", ["config.json", "model.safetensors"]
    try:
        path = snapshot_download(repo, allow_patterns=files, local_files_only=True)
    except OSError:  # not cached yet
        try:
            path = snapshot_download(repo, allow_patterns=files, etag_timeout=5)
        except (OSError, HfHubHTTPError) as err:
            raise ModelLoadError(
                f"cannot download {name!r} from the Hugging Face hub ({type(err).__name__}); "
                f"set MODEL to a local checkpoint directory or to random:{name}"
            ) from None
    return ModelSource(name, Path(path), None)


def read_config(directory: Path) -> GPTConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("model_type") != "gpt2":
        raise ModelLoadError(f"{path} is not a GPT-2 config (model_type={raw.get('model_type')!r})")
    activation = raw.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"{path}: activation_function {activation!r} is not GPT-2's gelu_new")
    return GPTConfig(
        n_layer=raw["n_layer"],
        n_head=raw["n_head"],
        n_embd=raw["n_embd"],
        n_positions=raw["n_positions"],
        vocab_size=raw["vocab_size"],
        layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
    )


def load_checkpoint_dir(directory: Path, device: torch.device, dtype: torch.dtype) -> GPT:
    config = read_config(directory)
    if (directory / "model.safetensors").is_file():
        state = load_file(directory / "model.safetensors")
    elif (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{directory} has no model.safetensors or pytorch_model.bin")
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(convert_hf_state_dict(state, model), assign=True)
    model.lm_head.weight = model.wte.weight  # assign=True replaced wte's parameter: re-tie
    return model.to(device=device, dtype=dtype).eval()


def convert_hf_state_dict(state: dict[str, torch.Tensor], model: GPT) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 keys and layouts to this model's."""
    expected = {k: v.shape for k, v in model.state_dict().items() if k != "lm_head.weight"}
    converted = {}
    for key, tensor in state.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers, not weights
        if key == "lm_head.weight":
            continue  # tied to wte
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # Conv1D stores [in, out]; nn.Linear wants [out, in]
        if key not in expected:
            raise ModelLoadError(f"unexpected weight {key!r} in checkpoint")
        if tensor.shape != expected[key]:
            raise ModelLoadError(f"weight {key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[key])}")
        converted[key] = tensor.contiguous()
    missing = expected.keys() - converted.keys()
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {min(missing)!r}")
    converted["lm_head.weight"] = converted["wte.weight"]
    return converted
