"""The engine: a runner (the model, or a simulation of one), its paged KV cache and a scheduler,
advanced one step at a time."""

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from itertools import repeat
from typing import NamedTuple, Protocol

import torch
from torch import nn

from config import EngineSettings
from generate import constraints
from generate.constraint_compiler import ConstraintCompiler
from generate.fair_share import FairShare
from generate.grammar_mask import GrammarMasks, StepMasks
from generate.lora_registry import LoraRegistry
from generate.model_runner import Launched, ModelRunner, kv_cache_dtype
from generate.scheduler import Scheduler
from generate.sequence import SamplingParams, Sequence, Status
from generate.step_log import StageClock, StepLog, StepRecord
from kvcache.block_manager import BlockManager, KVCacheExhausted
from kvcache.pool_size import default_budget_bytes, pool_blocks
from model import cpu_linear, host_memory, int8_linear
from model.cpu_features import native_bfloat16
from model.loader import load_model
from model.tokenizer import encode_prompt, load_tokenizer

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What computes a step: given the scheduled sequences (prefill chunks first), the next token of
    each whose scheduled tokens reach its end (`samples_this_step`), None for the others.

    It reads each sequence's block table, computed and scheduled token counts, and records
    logprobs and prompt logprobs (`Sequence.logits_positions`) on the sequences that ask for
    them; the engine does all the bookkeeping around it.
    It laps the clock after building its inputs ("build"), the forward pass ("forward"), waiting
    for the step's constraint masks ("mask") and sampling ("sample"). `masks` (None when no
    sampling sequence is constrained) are filling while it runs; the tokens it chooses for those
    rows must be ones the masks allow.
    """

    max_context: int
    on_gpu: bool  # sets the default token budget

    def run(self, seqs: list[Sequence], clock: StageClock, masks: StepMasks | None = None) -> list[int | None]: ...


class StepResult(NamedTuple):
    seq: Sequence
    token: int | None  # None: the step computed a prompt chunk that does not reach the prompt's end


class InFlight(NamedTuple):
    """A decode step launched on the device whose tokens the engine has not read yet."""

    seqs: list[Sequence]
    launched: Launched
    record: StepRecord
    clock: StageClock


class Engine:
    def __init__(
        self, runner: Runner, num_blocks: int, settings: EngineSettings, model_name: str = "", is_random: bool = False
    ):
        self.runner, self.model_name, self.is_random, self.settings = runner, model_name, is_random, settings
        self.max_context = runner.max_context
        self.max_batch_tokens = settings.batch_token_budget(runner.on_gpu, runner.max_context)
        self.blocks = BlockManager(num_blocks, settings.block_size, settings.prefix_cache)
        max_running = settings.max_running(runner.on_gpu, runner.max_context)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=max_running,
            max_num_batched_tokens=self.max_batch_tokens,
            chunked_prefill=settings.chunked_prefill,
            priority_aging_s=settings.priority_aging_s,
            priority_prefill_first=settings.priority_prefill_first,
            fair_order=settings.fair_share,
            fair=FairShare(settings.fair_share_input_weight, settings.fair_share_output_weight),
            max_loras=settings.max_loras,
        )
        config = runner.model.config if isinstance(runner, ModelRunner) else None
        self.loras = LoraRegistry(config, settings)  # adapters by name; a simulated engine serves none
        self.step_log = StepLog(settings.step_log_size)
        self.num_steps = 0
        self.constraints = ConstraintCompiler(settings)  # request threads compile with it, before admission
        self.grammar = GrammarMasks(constraints.VOCAB_SIZE, runner.on_gpu)  # .stats: structured output's counters
        # Asynchronous scheduling (ASYNC_SCHEDULING), `step`'s alone: decode steps the runner can launch (queue on
        # the device, read later) go one behind the other.
        overlap = isinstance(runner, ModelRunner) and settings.async_scheduling != "off"
        self.launcher: ModelRunner | None = runner if overlap else None
        self.in_flight: InFlight | None = None  # the step launched last, its tokens not read yet
        self.num_steps_ahead = 0  # steps launched before the step in front of them was read
        # called on the loop's thread as each step's forward pass begins (its inputs built): the engine's own process
        # sends the outputs of the step before then (batching/engine_process.py)
        self.before_forward: Callable[[], None] | None = None

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "Engine":
        """GPT-2 as MODEL, DEVICE and DTYPE say, over a KV pool sized by KV_CACHE_BLOCKS / KV_CACHE_GB."""
        assert settings.engine == "gpt2", "ENGINE=sim builds its engine with sim.engine.simulated_engine"
        device, dtype = device_and_dtype(settings)
        if device.type == "cpu":
            host_memory.keep_freed_memory()
        loaded = load_model(settings.model, device, dtype, settings.seed)
        set_products(loaded.model, settings, device, dtype)
        token_bytes = loaded.model.config.kv_bytes_per_token(dtype, kv_cache_dtype(settings, device))
        num_blocks = pool_blocks(settings, token_bytes, default_budget_bytes(device))
        if not settings.dtype and not settings.quantization:  # QUANTIZATION=int8 computes in float32 around it
            log.warning(
                "DTYPE unset: %s, the default on this %s (DTYPE=float32 for float32's exact results)", dtype, device
            )
        log.info(
            "model %s on %s/%s (CPU_LINEAR=%s, QUANTIZATION=%s); KV cache: %d blocks of %d tokens (%s)",
            loaded.name,
            device,
            dtype,
            settings.cpu_linear,
            settings.quantization or "none",
            num_blocks,
            settings.block_size,
            settings.kv_cache_dtype,
        )
        runner = ModelRunner.from_settings(loaded.model, num_blocks, settings)
        engine = cls(runner, num_blocks, settings, loaded.name, loaded.is_random)
        engine.loras.load_modules(settings.lora_modules)
        return engine

    @property
    def max_sequence_tokens(self) -> int:
        """The longest a sequence (prompt + generated tokens) can be: the context, or the whole KV cache."""
        return min(self.max_context, self.blocks.num_blocks * self.blocks.block_size)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never run here, or None if it can."""
        capacity = self.blocks.num_blocks * self.blocks.block_size
        return fit_problem(num_prompt_tokens, max_tokens, self.max_context, capacity)

    def add(self, seq: Sequence) -> None:
        problem = self.check_fits(seq.num_prompt_tokens, seq.params.max_tokens)
        if problem:
            raise ValueError(problem)
        self.grammar.stats.constrained_requests += seq.matcher is not None and seq.fork_of is None
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> list[StepResult]:
        """Schedule, run the model once over every scheduled sequence's tokens, retire finished.

        Every scheduled sequence gets a result; its token is None when its chunk stops short of
        the end of its prompt (or it computes its prompt only). A sequence ends only here, when
        `Sequence.append` says so or a prompt-only one has computed its prompt, or by `abort`.
        The step's record is `step_log.last`.

        Asynchronous scheduling is this method's alone, as mini-sglang's overlap_loop: a decode step that needs
        nothing back but its tokens is launched, and the next launched behind it before they are read, so the
        host's work for one step runs while the device computes the one before. That next step may still run
        when this returns: its results come from the next call, less those of sequences that ended meanwhile
        (their extra token is thrown away).
        """
        last = self.in_flight
        if last is None:  # nothing on the device: schedule a step
            clock = StageClock(self.before_forward)
            seqs = self.scheduler.schedule()
            if not seqs:
                return []
            seqs.sort(key=lambda s: s.num_scheduled_tokens == 1)  # multi-token chunks first, as the batch wants
            record = self._record(seqs, clock)
            clock.lap("schedule")
            if self.launcher is None or not self.launcher.can_launch(seqs):
                return self._run(seqs, record, clock)
            last = InFlight(seqs, self.launcher.launch(seqs, clock), record, clock)
        # The overlap is this order: launch the next step behind `last`, then read `last` (read first, the device
        # would wait while the host retires it and builds the next).
        self.in_flight = self._launch_behind(last)
        return self._complete(last, self.in_flight)

    def _run(self, seqs: list[Sequence], record: StepRecord, clock: StageClock) -> list[StepResult]:
        """The step on the runner, waiting for its tokens."""
        masks = self.grammar.start(seqs)  # filled on a worker thread while the forward pass runs
        tokens = self.runner.run(seqs, clock, masks)
        self.grammar.finish(masks, clock.stages.get("mask", 0.0))
        assert len(tokens) == len(seqs)
        return self._retire(seqs, tokens, record, clock)

    def _launch_behind(self, last: InFlight) -> InFlight | None:
        """The next step, launched behind `last` before its tokens are read: `last`'s sequences still running, each
        computing the token `last` draws for it, one past its token list. Only when that is the step `schedule`
        would run: nobody else runs or can join them, and the pool has each a slot without preempting. Otherwise
        None: the next call reads `last` and schedules as usual."""
        rows = [i for i, s in enumerate(last.seqs) if s.status is Status.RUNNING]  # not ended or aborted meanwhile
        seqs = [last.seqs[i] for i in rows]
        clock = StageClock(self.before_forward)
        if not seqs or not self.scheduler.runs_alone(seqs):
            return None
        positions = [len(s.token_ids) for s in seqs]  # of the tokens on their way
        try:
            for seq, position in zip(seqs, positions):
                self.blocks.append_slot(seq, position + 1)
        except KVCacheExhausted:
            return None  # those given a block keep it: the token they make room for is on its way
        self.scheduler.charge(seqs)
        record = self._record(seqs, clock)
        clock.lap("schedule")
        self.num_steps_ahead += 1
        launched = self.launcher.launch(seqs, clock, positions, last.launched.tokens_at(rows))
        return InFlight(seqs, launched, record, clock)

    def _complete(self, last: InFlight, behind: InFlight | None) -> list[StepResult]:
        """Read a launched step's tokens and retire it; `behind`, launched after it, computes those tokens."""
        tokens = last.launched.read()
        clock = last.clock
        clock.lap("sample")
        # the tokens of sequences that ended meanwhile are thrown away (nor counted as sampled)
        live = [(s, t) for s, t in zip(last.seqs, tokens) if s.status is Status.RUNNING]
        results = self._retire([s for s, _ in live], [t for _, t in live], last.record, clock)
        for seq in behind.seqs if behind else []:
            seq.num_scheduled_tokens = 1  # the token just appended, which `behind` computes
        return results

    def _retire(
        self, seqs: list[Sequence], tokens: list[int | None], record: StepRecord, clock: StageClock
    ) -> list[StepResult]:
        """A computed step's bookkeeping: what is in the cache, the tokens appended, finished sequences out. A
        constrained sequence's drawn token may be followed by tokens its grammar forces (`_jump_forward`): each is a
        result of its own, after the drawn one."""
        forced: dict[int, list[int]] = {}
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            assert (token is not None) == seq.samples_this_step
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.blocks.commit(seq, seq.num_computed_tokens)
            if token is not None:
                seq.append(token)  # which decides whether the sequence ends here
                if seq.matcher is not None and (appended := self._jump_forward(seq)):
                    forced[row] = appended
            elif seq.prompt_only and seq.num_computed_tokens == seq.num_prompt_tokens:
                seq.end("length")  # nothing to generate: its prompt's log-probabilities were the point
            if seq.status is Status.FINISHED:
                self.scheduler.finish(seq)
        record.num_sampled = len(tokens) - tokens.count(None)
        record.stages = clock.stages
        record.duration_s = clock.elapsed()
        self.step_log.append(record)  # once computed: a launched step's record waits for its tokens
        # tuple.__new__ itself, not the NamedTuple's __new__ (a Python call a row, a twentieth of the loop's time)
        results = list(map(tuple.__new__, repeat(StepResult), zip(seqs, tokens)))
        if forced:
            spliced = []
            for row, drawn in enumerate(results):
                spliced.append(drawn)
                spliced += [StepResult(drawn.seq, token) for token in forced.get(row, ())]
            results = spliced
        return results

    def _jump_forward(self, seq: Sequence) -> list[int]:
        """Append the tokens the sequence's grammar forces next (JUMP_FORWARD), as SGLang's jump-forward decoding:
        each is the only token its mask would allow (llguidance's fast-forward tokens), so a step that drew it
        would draw the same, and the next step computes them with the next draw, as a prompt chunk. Appended one
        by one, each can end the sequence as a drawn one does (its length, a stop string). Not where the request
        wants log-probabilities (a forced token has none) or biases logits (which could forbid a forced token)."""
        params = seq.params
        if not self.settings.jump_forward or seq.status is not Status.RUNNING:
            return []
        if params.logprobs is not None or params.logit_bias:
            return []
        appended = []
        for token in seq.matcher.compute_ff_tokens():
            if seq.status is not Status.RUNNING:
                break
            seq.append(token)
            appended.append(token)
        return appended

    def _record(self, seqs: list[Sequence], clock: StageClock) -> StepRecord:
        self.num_steps += 1
        # a prompt chunk, or the recomputation of a preempted sequence; a decode computes its one new token
        prefills = [s for s in seqs if s.num_scheduled_tokens > 1 or s.num_computed_tokens < s.num_prompt_tokens]
        blocks, scheduler = self.blocks, self.scheduler
        return StepRecord(
            index=self.num_steps,
            started_at=clock.started_at,
            num_decodes=len(seqs) - len(prefills),
            num_prefills=len(prefills),
            num_prefill_tokens=sum(s.num_scheduled_tokens for s in prefills),
            num_sampled=0,  # counted from its tokens when the step is retired
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=blocks.num_used_blocks,
            kv_blocks_cached=blocks.num_cached_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            preemptions=scheduler.num_preemptions,
        )

    def generate(self, prompts: Seq[Seq[int] | str], params: SamplingParams | Seq[SamplingParams]) -> list[list[int]]:
        """Generate for every prompt (token ids or text) through the scheduler; completions in order."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        tokenizer = load_tokenizer() if any(isinstance(p, str) for p in prompts) else None
        ids = [encode_prompt(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
        seqs = [Sequence(prompt, sp) for prompt, sp in zip(ids, params)]
        for seq in seqs:
            self.add(seq)
        while self.has_work():
            self.step()
        return [seq.completion_ids for seq in seqs]


def device_and_dtype(settings: EngineSettings) -> tuple[torch.device, torch.dtype]:
    """DEVICE and DTYPE, or their defaults: cuda if available, else cpu; float16 on cuda; on a cpu bfloat16
    where it computes bfloat16 natively (2-3x float32's speed there), else float32; float32 under QUANTIZATION."""
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    unset = "float32" if settings.quantization else default_dtype(device)  # int8 products take float32 around them
    return device, getattr(torch, settings.dtype or unset)


def set_products(model: nn.Module, settings: EngineSettings, device: torch.device, dtype: torch.dtype) -> None:
    """The model's matrix products as the settings want them: int8 (QUANTIZATION), else through oneDNN on a
    CPU (CPU_LINEAR), else torch's own."""
    if settings.quantization:
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"QUANTIZATION=int8 runs on a CPU in float32 (DTYPE=float32), not {device.type}/{dtype}")
        if not int8_linear.available():
            raise ValueError("QUANTIZATION=int8 needs oneDNN's quantized linear, which this torch build lacks")
        int8_linear.quantize(model)
    elif cpu_linear.wanted(settings.cpu_linear, device, dtype):
        cpu_linear.use_onednn(model)


def default_dtype(device: torch.device) -> str:
    if device.type == "cuda":
        return "float16"
    return "bfloat16" if native_bfloat16() else "float32"


def fit_problem(num_prompt_tokens: int, max_tokens: int, max_context: int, cache_tokens: int) -> str | None:
    """Why a request can never run on a model of `max_context` over a KV cache of `cache_tokens`, or None."""
    total = num_prompt_tokens + max_tokens
    if total > max_context:
        return (
            f"prompt ({num_prompt_tokens} tokens) + max tokens ({max_tokens}) = {total} exceeds the "
            f"{max_context}-token context"
        )
    if total > cache_tokens:
        return f"prompt + max tokens ({total}) exceeds the whole KV cache ({cache_tokens} tokens)"
    return None
