"""The engine's constraint compiler: compiles on request threads, before admission, so the loop never does.

Compiles are cached (a bounded LRU keyed by the constraint; concurrent requests for the same
constraint wait for one compile) and time-limited (CONSTRAINT_COMPILE_TIMEOUT_S). Each compiler
holds its own settings, cache and compile threads: the engine owns one, and a cache never mixes
compiles made under different settings (STRUCTURED_OPEN_OBJECTS changes what a schema means).

llguidance builds a matcher recursively: a chain of a few thousand rules (a 46 KB grammar, or a JSON
schema of $refs) overflowed a thread's default 8 MiB stack and killed the process. Its compile threads
have 256 MiB stacks (address space, touched only as deep as a compile goes), where 20,000 chained
rules build. A compile still running at its limit keeps its thread, which cannot be stopped; another
thread takes its place, up to MAX_OVERDUE such at once, so that slow compiles cannot take the
compiler from everyone else. Past that, a compile that cannot start in time is refused as busy.
"""

import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance

from config import EngineSettings
from generate.constraints import KIND_NAMES, CompiledConstraint, Constraint, ConstraintError, to_grammar, tokenizer

THREADS = 2  # compiles at once
STACK_BYTES = 256 << 20
MAX_OVERDUE = 2  # threads still busy with a compile past its limit, each replaced by a fresh one


class CompilerBusy(ConstraintError):
    """No compile thread was free within the time limit: the server's state, not the constraint's fault."""


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


@dataclass(eq=False, slots=True)
class _Task:
    work: Callable[[], object]
    future: Future
    replaced: bool = False  # its caller gave up while it ran, and another thread took its thread's place


class _CompileThreads:
    """THREADS threads with deep stacks running compiles; one busy past its caller's limit is replaced."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._overdue = 0  # threads still running a replaced task; guarded by _lock
        for _ in range(THREADS):
            self._spawn()

    def run(self, work: Callable[[], object], timeout_s: float) -> object:
        task = _Task(work, Future())
        self._tasks.put(task)
        try:
            return task.future.result(timeout=timeout_s)
        except FutureTimeout:
            if task.future.cancel():  # never started: every thread was busy
                raise CompilerBusy(f"no constraint compiler was free within {timeout_s:g} s; retry") from None
            with self._lock:
                task.replaced = self._overdue < MAX_OVERDUE
                self._overdue += task.replaced
            if task.replaced:
                self._spawn()
            raise ConstraintError(f"compiling the constraint took longer than {timeout_s:g} s") from None

    def _spawn(self) -> None:
        with self._lock:  # the stack size is the process's for threads started meanwhile: set and reset together
            previous = threading.stack_size(STACK_BYTES)
            try:
                threading.Thread(target=self._work, name="constraint-compile", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            if not task.future.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            try:
                task.future.set_result(task.work())
            except BaseException as err:  # noqa: BLE001 - handed to the caller, which raises it
                task.future.set_exception(err)
            with self._lock:
                if task.replaced:  # another thread took this one's place meanwhile: leave it
                    self._overdue -= 1
                    return


class ConstraintCompiler:
    """Thread-safe; built once per engine, which also builds the vocabulary's tables now rather than in
    the first constrained request."""

    def __init__(self, settings: EngineSettings) -> None:
        self.timeout_s = settings.constraint_compile_timeout_s
        self.open_objects = settings.structured_open_objects
        self._cache = _Cache(settings.constraint_cache_size)
        self._threads = _CompileThreads()
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
        try:
            grammar = to_grammar(c, self.open_objects)
        except RecursionError:  # a JSON schema nested past Python's recursion limit
            raise ConstraintError(f"the {KIND_NAMES[c.kind]} is nested too deeply") from None
        # llguidance releases the GIL while it builds a matcher: on a compile thread, the request waits
        matcher = self._threads.run(lambda: llguidance.LLMatcher(tokenizer(), grammar, log_level=0), timeout_s)
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
