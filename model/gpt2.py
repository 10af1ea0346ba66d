"""GPT-2 over a paged KV cache, in one file (after nanoGPT's model.py).

The forward pass takes a flat batch: the new tokens of many sequences concatenated
(whole prompts, the uncached tail of a prompt, or one token of a decoding sequence),
with their positions. Each layer writes the new keys/values into the cache slots the
block manager handed out, then every sequence attends over its own slots only. Logits
come out only for the rows that need a next token.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import LayerKV, StepAttention, paged_cache, paged_scales

if TYPE_CHECKING:
    from model.lora_slots import LoraStep


@dataclass(frozen=True, slots=True)
class GPTConfig:
    n_layer: int = 24
    n_head: int = 16
    n_embd: int = 1024
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def kv_bytes_per_token(self, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> int:
        """A token's keys and values over every layer: in `cache_dtype` (quantized, with a float32 scale per head)
        or else in the model's `dtype`."""
        if cache_dtype is None:
            return 2 * self.n_layer * self.n_embd * dtype.itemsize
        return 2 * self.n_layer * (self.n_embd * cache_dtype.itemsize + self.n_head * 4)


PRESETS = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] their positions in their sequences
    slot_mapping: torch.Tensor  # [T] cache slot each new key/value is written to
    attention: StepAttention  # how the rows attend over the cache (model/attention.py)
    logits_rows: torch.Tensor | None  # [N] rows whose next token is wanted; None: every row
    lora: "LoraStep | None" = None  # each row's LoRA adapter (model/lora_slots.py); None: every row is the base's


def with_lora(y: torch.Tensor, x: torch.Tensor, batch: StepBatch, layer: int, target: str) -> torch.Tensor:
    """A target's output y = f(x), plus each row's adapter delta when the step has adapter rows."""
    return y if batch.lora is None else batch.lora.add(y, x, (layer, target))  # [T, out]


def add_norm(
    x: torch.Tensor, y: torch.Tensor, norm: nn.LayerNorm | None, batch: StepBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + y and norm(x + y) ([T, C] each; None without a norm). With the Triton backend one kernel does both
    (a launch and a reread of the sum saved); the other backends run PyTorch's two ops, as always."""
    if norm is not None and batch.attention.fused_norms:
        from model.triton_norm import add_layer_norm  # only where triton is installed

        return add_layer_norm(x, y, norm.weight, norm.bias, norm.eps)
    total = x + y  # [T, C]
    return total, None if norm is None else norm(total)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head, self.head_dim, self.layer = config.n_head, config.head_dim, layer
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, kv_cache: LayerKV, batch: StepBatch) -> torch.Tensor:
        T, C = x.shape
        q, k, v = with_lora(self.c_attn(x), x, batch, self.layer, "attn.c_attn").split(C, dim=1)  # 3 x [T, C]
        q = q.view(T, self.n_head, self.head_dim)  # [T, H, D]
        shape = (T, self.n_head, self.head_dim)
        batch.attention.store(kv_cache, k.view(shape), v.view(shape), batch.slot_mapping)
        y = batch.attention.attend(q, kv_cache)  # [T, C]
        return with_lora(self.c_proj(y), y, batch, self.layer, "attn.c_proj")  # [T, C]


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (exact GELU drifts): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3). On a CPU in float32
    as x sigmoid(2u), the same function (1 + tanh(u) = 2 sigmoid(2u)) in torch's faster elementwise kernels: 1.1
    against 1.6 ms at 256 x 3072 (Zen 3). In place: `x` is the product just made."""
    if x.device.type != "cpu" or x.dtype != torch.float32:  # bfloat16 would round each intermediate
        return F.gelu(x, approximate="tanh")
    a = 2 * math.sqrt(2 / math.pi)
    two_u = x.square().mul_(a * 0.044715).add_(a).mul_(x)  # [T, 4C]: 2u
    return x.mul_(two_u.sigmoid_())  # [T, 4C]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        if batch.lora is None and getattr(self.c_fc, "fuses_gelu", False):  # oneDNN's, bfloat16 (model/cpu_linear.py)
            h = self.c_fc.gelu_after(x)  # [T, 4C]
        else:  # an adapter's delta goes in before the GELU
            h = gelu_new(with_lora(self.c_fc(x), x, batch, self.layer, "mlp.c_fc"))  # [T, 4C]
        return with_lora(self.c_proj(h), h, batch, self.layer, "mlp.c_proj")  # [T, C]


class Block(nn.Module):
    """nanoGPT's block, each residual add fused with the LayerNorm that reads its sum (add_norm: one kernel):

        nanoGPT                            here
        x = x + self.attn(self.ln_1(x))    x, ln_2_x = add_norm(x, self.attn(ln_1_x), self.ln_2)
        x = x + self.mlp(self.ln_2(x))     x, next_x = add_norm(x, self.mlp(ln_2_x), next_norm)

    So its ln_1 has run before it, with the add before it (the embeddings', or the previous block's second),
    and its second add runs the norm after it: a block takes x and ln_1(x) and returns x and next_norm(x),
    next_norm being the next block's ln_1, or after the last block ln_f (None: ln_f runs apart, GPT.forward).
    """

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = MLP(config, layer)

    def forward(
        self, x: torch.Tensor, ln_1_x: torch.Tensor, kv_cache: LayerKV, batch: StepBatch, next_norm: nn.LayerNorm | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the residual stream, ln_1_x: self.ln_1(x). Returns the stream after the block and next_norm of it."""
        x, ln_2_x = add_norm(x, self.attn(ln_1_x, kv_cache, batch), self.ln_2, batch)  # [T, C] each
        return add_norm(x, self.mlp(ln_2_x, batch), next_norm, batch)  # [T, C], [T, C] or None


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in the released checkpoints
        self.kv_cache: list[LayerKV] | None = None  # a layer's each

    def init_random(self, seed: int) -> None:
        """nanoGPT's initialisation, from a private generator so the seed fixes the weights."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            else:
                # residual projections scaled down with depth, as in GPT-2's paper
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std, generator=gen)

    def pad_vocab(self, multiple: int) -> None:
        """Zero rows under the tied embedding and LM head up to a multiple of `multiple`, as nanoGPT does:
        cuBLAS takes its fast kernels only for a row count divisible by 8, and GPT-2's 50257 is odd (on an
        H200 the LM head at 256 rows ran 280 us in an sm75 kernel). Logits keep vocab_size columns."""
        weight = self.wte.weight  # [V, C]
        rows = -(-weight.shape[0] // multiple) * multiple
        if rows != weight.shape[0]:
            padded = weight.new_zeros((rows, weight.shape[1]))  # [Vp, C]
            padded[: weight.shape[0]] = weight
            self.wte.weight = nn.Parameter(padded, requires_grad=weight.requires_grad)
            self.lm_head.weight = self.wte.weight

    def allocate_kv_cache(self, num_blocks: int, block_size: int, cache_dtype: torch.dtype | None = None) -> None:
        """Every layer's keys and values in the model's dtype, or quantized to `cache_dtype` with their scales."""
        c, p = self.config, self.wte.weight
        pool = dict(blocks=num_blocks, block_size=block_size, heads=c.n_head, device=p.device)
        kv = paged_cache(c.n_layer, 2, **pool, head_dim=c.head_dim, dtype=cache_dtype or p.dtype)  # [L,2,NB,bs,H,D]
        if cache_dtype is None:
            self.kv_cache = [LayerKV(k, v) for k, v in kv]
            return
        scales = paged_scales(c.n_layer, 2, **pool)  # [L, 2, NB, bs, H]
        self.kv_cache = [LayerKV(k, v, k_scale, v_scale) for (k, v), (k_scale, v_scale) in zip(kv, scales)]

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        assert self.kv_cache is not None, "allocate_kv_cache() first"
        rows, fused = batch.logits_rows, batch.attention.fused_norms
        # Each residual add runs with the norm that reads its sum (Block), so each block is handed the norm after
        # it, the next block's ln_1 (the list shifted by one), and block 0's ln_1 runs with the embeddings' add:
        #
        #   wte + wpe --add, h[0].ln_1--> h[0] --add, h[1].ln_1--> h[1] ... h[L-1] --add, ln_f--> lm_head
        #
        # Fused, the last block's add takes ln_f over every row: writing T normalised rows costs less than launching
        # the add and ln_f apart, and a row's norm is the same however many run. Unfused, ln_f runs after, on the
        # wanted rows only.
        next_norms = [block.ln_1 for block in self.h[1:]] + [self.ln_f if fused else None]
        x, normed = add_norm(self.wte(batch.input_ids), self.wpe(batch.positions), self.h[0].ln_1, batch)  # [T, C]
        for layer, (block, next_norm) in enumerate(zip(self.h, next_norms)):
            x, normed = block(x, normed, self.kv_cache[layer], batch, next_norm)  # normed: next_norm(x), or None
        if normed is None:  # ln_f on the wanted rows only
            normed = self.ln_f(x if rows is None else x[rows])  # [N, C]
        elif rows is not None:
            normed = normed[rows]  # [N, C]
        return self.lm_head(normed)[:, : self.config.vocab_size].float()  # [N, V]
