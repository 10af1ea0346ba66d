"""The adapters this server holds, by name: loaded at start (LORA_MODULES) or while serving, unloaded
while serving. Request threads read and change it; the lock keeps each change whole.

A sequence carries its adapter object itself (Sequence.lora), so the engine never looks a name up:
an adapter unloaded while a request was between its lookup and the queue still serves that request.
Unloading is refused while accepted requests use the adapter (`in_flight`, counted by the batching
manager from acceptance to answer): the caller retries once they are done.
"""

import itertools
import threading

from config import EngineSettings
from model.gpt2 import GPTConfig
from model.lora import LoraAdapter, LoraError, read_adapter


class LoraNotFound(LookupError):
    """No adapter of that name is loaded."""


class LoraInUse(Exception):
    """The adapter still has requests in flight."""


class LoraRegistry:
    def __init__(self, config: GPTConfig | None, settings: EngineSettings):
        self.config = config  # None: the engine simulates its steps and serves no adapters
        self.max_rank, self.max_held = settings.max_lora_rank, settings.max_cpu_loras
        self._adapters: dict[str, LoraAdapter] = {}
        self._ids = itertools.count(1)  # 0 is the base model
        self._lock = threading.Lock()

    def load(self, name: str, path: str, root: str | None = None) -> LoraAdapter:
        """Read and register the adapter at `path` (under `root`, if given: loads while serving) as `name`;
        LoraError (or ValueError) says why not."""
        if self.config is None:
            raise LoraError("this engine (ENGINE=sim) serves no LoRA adapters")
        with self._lock:
            self._check_name(name)
        rank, weights = read_adapter(path, self.config, self.max_rank, root)  # outside the lock: it reads files
        with self._lock:
            self._check_name(name)  # again: another request may have taken it meanwhile
            adapter = LoraAdapter(name, path, next(self._ids), rank, weights)
            self._adapters[name] = adapter
        return adapter

    def _check_name(self, name: str) -> None:
        if name in self._adapters:
            raise ValueError(f"the LoRA adapter '{name}' has already been loaded")
        if len(self._adapters) >= self.max_held:
            raise ValueError(f"{len(self._adapters)} adapters are loaded, MAX_CPU_LORAS: unload one first")

    def unload(self, name: str) -> None:
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise LoraNotFound(f"the LoRA adapter '{name}' cannot be found")
            if adapter.in_flight:
                raise LoraInUse(f"the LoRA adapter '{name}' is in use by {adapter.in_flight} requests; retry later")
            del self._adapters[name]

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def adapters(self) -> list[LoraAdapter]:
        """Every loaded adapter, in load order."""
        with self._lock:
            return list(self._adapters.values())

    def hold(self, adapter: LoraAdapter | None) -> None:
        """A request of this adapter was accepted (None: the base model's)."""
        if adapter is not None:
            with self._lock:
                adapter.in_flight += 1

    def release(self, adapter: LoraAdapter | None) -> None:
        """... and has been answered."""
        if adapter is not None:
            with self._lock:
                assert adapter.in_flight > 0, f"LoRA adapter '{adapter.name}' released more than held"
                adapter.in_flight -= 1

    def load_modules(self, modules: str) -> None:
        """LORA_MODULES: `name=path,name=path`."""
        for item in filter(None, (m.strip() for m in modules.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"LORA_MODULES entries are name=path, got {item!r}")
            self.load(name.strip(), path.strip())
