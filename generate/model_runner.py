"""Run GPT-2 over the scheduled sequences: build the step's inputs, forward, then the sampler."""

import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from config import EngineSettings
from generate.grammar_mask import StepMasks
from generate.sampler import Sampler, needs_host_state
from generate.sequence import Sequence
from generate.step_input import build_step_inputs, reference_groups, upload
from generate.step_log import StageClock
from model import cpu_attention
from model.attention import CACHE_DTYPES, GatherSpace, PagedInputs, ReferenceAttention, StepAttention
from model.cpu_attention import CpuAttention
from model.gpt2 import GPT, StepBatch
from model.lora_slots import LoraSlots, LoraStep

if TYPE_CHECKING:
    from generate.cuda_graphs import DecodeGraphs

GRAPH_MODES = ("off", "eager", "capture")  # eager: the graphs' static buffers, run without capture (CPU tests)
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A decode step queued on the device, its tokens not read back yet (ModelRunner.launch)."""

    tokens: torch.Tensor  # [n] on the device, where the next step can take them as its inputs
    host: torch.Tensor  # [n] their copy in pinned memory, complete once `ready` has passed
    ready: "torch.cuda.Event | None"  # None on a CPU, where the copy is done before launch returns

    def read(self) -> list[int]:
        """The step's tokens, waiting for this step only (not for any queued behind it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def tokens_at(self, rows: list[int]) -> torch.Tensor:
        """These rows' tokens ([len(rows)]), still on the device: queued behind the step, not waiting for it."""
        if rows == list(range(len(self.tokens))):
            return self.tokens
        return self.tokens[upload(self.tokens.device, rows=rows)["rows"]]  # the indices go up in one pinned copy


class ModelRunner:
    """Owns the model and its KV cache tensor; the engine owns which slots each sequence uses.

    The cache has one block more than the pool: a scratch block that the padding rows of a
    CUDA-graph batch write to, which no sequence ever owns.
    """

    def __init__(
        self,
        model: GPT,
        num_blocks: int,
        block_size: int,
        attention: str = "reference",
        graphs: str = "off",
        max_batch_size: int = 256,
        max_loras: int = 4,
        max_lora_rank: int = 16,
        cache_dtype: torch.dtype | None = None,
    ):
        assert graphs in GRAPH_MODES and (graphs == "off" or attention == "triton"), "graphs replay the paged kernel"
        self.model, self.block_size, self.attention = model, block_size, attention
        self.device = model.wte.weight.device
        self.max_context = model.config.n_positions
        self.on_gpu = self.device.type == "cuda"
        self.space = GatherSpace()
        self.sampler = Sampler(self.device)
        self.lora_slots = LoraSlots(model.config, max_loras, max_lora_rank, self.device, model.wte.weight.dtype)
        if self.on_gpu:
            model.pad_vocab(64)
        model.allocate_kv_cache(num_blocks + 1, block_size, cache_dtype)
        assert attention != "cpu" or cpu_attention.available(), cpu_attention.build_problem()
        if attention == "triton":
            self._warm_kernel(scratch_block=num_blocks)
        self.graphs: DecodeGraphs | None = None
        if graphs != "off":
            from generate import cuda_graphs  # needs triton

            self.graphs = cuda_graphs.DecodeGraphs(model, max_batch_size, block_size, scratch_block=num_blocks)
            if graphs == "capture":
                start = time.perf_counter()
                self.graphs.capture()
                seconds = time.perf_counter() - start
                log.info("CUDA graphs: %d batch sizes captured in %.1f s", len(self.graphs.sizes), seconds)

    def _warm_kernel(self, scratch_block: int) -> None:
        """Compile the kernel's variants before serving: a two-token chunk (tiles of rows) and a decode row
        (one row), through the whole model as a step runs it, writing only the scratch block. The decode row's
        table is as wide as a context, so its keys are split (model/triton_attention.py, `partitions`)."""
        from model.triton_attention import TritonAttention

        start = time.perf_counter()
        bs = self.block_size
        for rows in (2, 1):
            blocks = -(-rows // bs) if rows > 1 else -(-self.max_context // bs)  # every one the scratch block
            t = upload(
                self.device,
                ids=[0] * rows,
                positions=list(range(rows)),
                slots=[scratch_block * bs + i % bs for i in range(rows)],
                query_start=[0, rows],
                context_lens=[rows],
                block_tables=[scratch_block] * blocks,
            )
            paged = PagedInputs(t["query_start"], t["context_lens"], t["block_tables"].view(1, blocks), rows)
            self.model(StepBatch(t["ids"], t["positions"], t["slots"], TritonAttention(paged), None))
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        log.info("Triton kernel: chunk and decode variants compiled in %.1f s", time.perf_counter() - start)

    @classmethod
    def from_settings(cls, model: GPT, num_blocks: int, settings: EngineSettings) -> "ModelRunner":
        """ATTENTION_BACKEND auto: the Triton kernel on CUDA when triton is installed, the C++ kernel on a CPU
        when it builds there, else the reference. CUDA_GRAPHS auto: decode steps from graphs whenever the
        Triton kernel runs on CUDA."""
        device = model.wte.weight.device
        attention = settings.attention_backend
        head_dim = model.config.head_dim
        kernel_fits = _triton_fits(head_dim)
        cache = kv_cache_dtype(settings, device)
        if attention == "auto":
            attention = _auto_attention(device, model.wte.weight.dtype, head_dim, cache)
        if attention == "cpu":
            _check_cpu_kernel(device, model.wte.weight.dtype, head_dim, cache)
        if attention == "triton" and not kernel_fits:
            raise ValueError(f"ATTENTION_BACKEND=triton needs a head dimension that is a power of two, not {head_dim}")
        if attention == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("ATTENTION_BACKEND=triton needs the triton package (it comes with CUDA builds of torch)")
        if attention == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("ATTENTION_BACKEND=triton runs on CUDA, or on CPU under TRITON_INTERPRET=1")
        if attention == "triton" and cache == torch.float8_e4m3fn and device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if capability < (8, 9):  # Triton converts float8 e4m3 from sm_89 (Ada, Hopper) on; e5m2 everywhere
                raise ValueError(
                    f"KV_CACHE_DTYPE={settings.kv_cache_dtype} (float8 e4m3) with the Triton kernel needs a GPU of "
                    f"compute capability 8.9 or later, not {capability[0]}.{capability[1]}: use fp8_e5m2 or int8"
                )
        on_cuda = attention == "triton" and device.type == "cuda"
        graphs = "capture" if settings.cuda_graphs == "auto" and on_cuda else "off"
        max_batch = settings.max_running(device.type == "cuda", model.config.n_positions)
        loras = settings.max_loras, settings.max_lora_rank
        return cls(model, num_blocks, settings.block_size, attention, graphs, max_batch, *loras, cache)

    def run(self, seqs: list[Sequence], clock: StageClock, masks: StepMasks | None = None) -> list[int | None]:
        """One forward over every sequence's scheduled tokens (chunks first); the next token of each
        sequence whose chunk reaches its end, None for the others."""
        logits = self._forward(seqs, clock)  # [N, V]: the rows each sequence asks for (Sequence.logits_positions)
        clock.lap("forward")
        if masks is not None:
            masks.wait()
            clock.lap("mask")
        tokens = self.sampler(seqs, logits, masks)  # the step's one device-to-host transfer: the sampled tokens
        clock.lap("sample")
        return tokens

    def can_launch(self, seqs: list[Sequence]) -> bool:
        """Whether `launch` can run this step: a decode step the graphs replay, with no adapter, whose
        sampling needs nothing read back on the host (generate/sampler.py, needs_host_state)."""
        if self.graphs is None or not self.graphs.fits(seqs):
            return False
        return all(s.lora is None and not needs_host_state(s) for s in seqs)

    def launch(
        self,
        seqs: list[Sequence],
        clock: StageClock,
        positions: list[int] | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> Launched:
        """Queue a decode step, its sampling and the copy of its tokens to the host, without waiting for them.

        Each row computes one token and draws the one after it: by default its sequence's last; else the row's
        `input_ids` ([n], on the device) at its `positions` (DecodeGraphs.prepare).
        """
        assert self.graphs is not None, "launch runs only what can_launch allows"
        self.graphs.prepare(seqs, positions, input_ids)
        clock.lap("build")
        logits = self.graphs.replay(len(seqs))  # [n, V]
        clock.lap("forward")
        drawn_at = None if positions is None else [p + 1 for p in positions]
        tokens = self.sampler.on_device(seqs, logits, drawn_at)  # [n]
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.on_gpu)
        host.copy_(tokens, non_blocking=self.on_gpu)  # a blocking copy would wait for every step queued
        ready = torch.cuda.Event() if self.on_gpu else None
        if ready is not None:
            ready.record()
        return Launched(tokens, host, ready)

    def _forward(self, seqs: list[Sequence], clock: StageClock) -> torch.Tensor:
        lora = self._lora_step(seqs)
        if lora is None and self.graphs is not None and self.graphs.fits(seqs):  # graphs hold no adapters
            self.graphs.prepare(seqs)
            clock.lap("build")
            return self.graphs.replay(len(seqs))
        inputs = build_step_inputs(seqs, self.block_size, self.device)
        batch = StepBatch(
            inputs.input_ids,
            inputs.positions,
            inputs.slot_mapping,
            self.step_attention(seqs, inputs.paged),
            inputs.logits_rows,
            lora,
        )
        clock.lap("build")
        return self.model(batch)

    def _lora_step(self, seqs: list[Sequence]) -> LoraStep | None:
        """Each row's adapter slot, the adapters copied into slots as needed; None when no row has an adapter."""
        adapters = [s.lora for s in seqs if s.lora is not None]
        if not adapters:
            return None
        slot = self.lora_slots.place(adapters)
        return self.lora_slots.step([slot.get(s.lora_id, -1) for s in seqs for _ in range(s.num_scheduled_tokens)])

    def step_attention(self, seqs: list[Sequence], paged: PagedInputs) -> StepAttention:
        """How the step's rows attend, by this runner's backend."""
        if self.attention == "cpu":
            return CpuAttention(paged)
        if self.attention == "triton":
            from model.triton_attention import TritonAttention  # only where triton is installed

            return TritonAttention(paged)
        return ReferenceAttention(reference_groups(seqs, self.block_size, self.device), self.space)


def kv_cache_dtype(settings: EngineSettings, device: torch.device) -> torch.dtype | None:
    """KV_CACHE_DTYPE as the cache stores it (None: the model's dtype). fp8 is a GPU's (on a CPU only the
    reference backend reads it, slowly, as the tests do); int8 runs everywhere."""
    cache = CACHE_DTYPES[settings.kv_cache_dtype]
    fp8 = cache is not None and cache.is_floating_point
    if fp8 and device.type != "cuda" and settings.attention_backend not in ("reference", "triton"):
        raise ValueError(f"KV_CACHE_DTYPE={settings.kv_cache_dtype} runs on CUDA; on a CPU use int8")
    return cache


def _triton_fits(head_dim: int) -> bool:
    return head_dim & (head_dim - 1) == 0  # the Triton kernel's tiles need a power of two (GPT-2's: 64)


def _auto_attention(device: torch.device, dtype: torch.dtype, head_dim: int, cache: torch.dtype | None) -> str:
    if device.type == "cuda":
        usable = _triton_fits(head_dim) and importlib.util.find_spec("triton")
        return "triton" if usable else "reference"
    fits = device.type == "cpu" and cpu_attention.fits(dtype, head_dim, cache)
    return "cpu" if fits and cpu_attention.available() else "reference"


def _check_cpu_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, cache: torch.dtype | None) -> None:
    if device.type != "cpu" or not cpu_attention.fits(dtype, head_dim, cache):
        raise ValueError(
            f"ATTENTION_BACKEND=cpu runs on a CPU in float32 or bfloat16 (its cache in that dtype or int8) with a "
            f"head dimension of {', '.join(map(str, cpu_attention.HEAD_DIMS))}: not {device.type}, {dtype}, {head_dim}"
            + (f" over a {cache} cache" if cache is not None else "")
        )
    if not cpu_attention.available():
        raise ValueError(f"ATTENTION_BACKEND=cpu: the kernel could not be built: {cpu_attention.build_problem()}")
