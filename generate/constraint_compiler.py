"""The engine's constraint compiler: compiles on request threads, before admission, so the loop never does.

Compiles are cached (a bounded LRU keyed by the constraint; concurrent requests for the same
constraint wait for one compile) and time-limited (CONSTRAINT_COMPILE_TIMEOUT_S). Each compiler
holds its own settings, cache and compile threads: the engine owns one, and a cache never mixes
compiles made under different settings (STRUCTURED_OPEN_OBJECTS changes what a schema means).
"""

import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance

from config import EngineSettings
from generate.constraints import KIND_NAMES, CompiledConstraint, Constraint, ConstraintError, to_grammar, tokenizer


@dataclass(frozen=True, slots=True)
class CompileStats:
    compiles: int  # constraints compiled (cache misses that succeeded)
    failures: int  # constraints refused (invalid, or over the time limit)
    cache_hits: int
    mean_s: float  # over the most recent compiles (up to 1000)
    p99_s: float


class _Cache:
    """Compiled constraints by constraint, least recently used first out; one compile per constraint
    at a time (later requests wait on the first one's future). Records compile times and hits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lock = threading.Lock()
        self.entries: OrderedDict[Constraint, Future] = OrderedDict()
        self.hits = self.misses = self.failures = 0
        self.compile_times: deque[float] = deque(maxlen=1000)  # seconds, the most recent compiles

    def get_or_start(self, c: Constraint) -> tuple[Future, bool]:
        """The constraint's future, and whether this caller must compile it."""
        with self.lock:
            future = self.entries.get(c)
            if future is not None:
                self.entries.move_to_end(c)
                self.hits += 1
                return future, False
            self.misses += 1
            future = self.entries[c] = Future()
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
            return future, True

    def forget(self, c: Constraint, future: Future) -> None:
        with self.lock:
            self.failures += 1
            if self.entries.get(c) is future:
                del self.entries[c]

    def record(self, seconds: float) -> None:
        with self.lock:
            self.compile_times.append(seconds)


class ConstraintCompiler:
    """Thread-safe; built once per engine, which also builds the vocabulary's tables now rather than in
    the first constrained request."""

    def __init__(self, settings: EngineSettings) -> None:
        self.timeout_s = settings.constraint_compile_timeout_s
        self.open_objects = settings.structured_open_objects
        self._cache = _Cache(settings.constraint_cache_size)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint-compile")
        tokenizer()

    def compile(self, c: Constraint) -> CompiledConstraint:
        """Compile (or take from the cache), within the time limit; raises ConstraintError."""
        future, mine = self._cache.get_or_start(c)
        if mine:
            try:
                future.set_result(self._compile_within(c, self.timeout_s))
            except BaseException as e:  # noqa: BLE001 - handed to the future: this caller and its waiters raise it
                self._cache.forget(c, future)
                future.set_exception(e)
        return future.result()  # a waiter's compile finishes or fails within the same limit

    def _compile_within(self, c: Constraint, timeout_s: float) -> CompiledConstraint:
        start = time.perf_counter()
        grammar = to_grammar(c, self.open_objects)
        # llguidance releases the GIL while it builds a matcher; a pathological grammar runs on in the
        # pool's thread past the limit, but the request is refused at the limit
        building = self._pool.submit(llguidance.LLMatcher, tokenizer(), grammar, log_level=0)
        try:
            matcher = building.result(timeout=timeout_s)
        except FutureTimeout:
            raise ConstraintError(f"compiling the constraint took longer than {timeout_s:g} s") from None
        if matcher.is_error():
            raise ConstraintError(f"invalid {KIND_NAMES[c.kind]}: {matcher.get_error()}")
        seconds = time.perf_counter() - start
        self._cache.record(seconds)
        return CompiledConstraint(c, grammar, matcher, seconds)

    def stats(self) -> CompileStats:
        cache = self._cache
        with cache.lock:
            times = sorted(cache.compile_times)
            hits, misses, failures = cache.hits, cache.misses, cache.failures
        p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
        mean = sum(times) / len(times) if times else 0.0
        return CompileStats(misses - failures, failures, hits, mean, p99)
