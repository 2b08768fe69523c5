"""The adapters an engine serves: names and their files, and the adapters loaded in
memory (at most max_cpu_loras, least recently used dropped and reloaded on demand).

Thread-safe: the server registers and removes adapters from its own threads while
the engine loop resolves requests' adapters. A request holds its `LoRAAdapter`
object, so removing an adapter never disturbs a request already running with it:
new requests cannot name it, running ones finish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from sluice.config import EngineConfig, ModelConfig
from sluice.core.errors import RequestError
from sluice.core.lora import LoRAAdapter, LoRARequest
from sluice.loader.lora import load_lora_adapter

logger = logging.getLogger("sluice")


class LoRARegistry:
    """Named adapters and the loaded ones, for one base model."""

    def __init__(self, model_config: ModelConfig, *, max_rank: int, max_cpu_loras: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._named: dict[str, LoRARequest] = {}
        self._loaded: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: EngineConfig, model_config: ModelConfig) -> LoRARegistry | None:
        """The registry of an engine with enable_lora (None without), its lora_modules
        loaded and checked now: a bad adapter fails the start, naming it."""
        if not config.enable_lora:
            return None
        cpu = config.max_cpu_loras or config.max_loras
        registry = cls(model_config, max_rank=config.max_lora_rank, max_cpu_loras=cpu)
        for request in config.lora_requests():
            registry.register(request)
        return registry

    def names(self) -> dict[str, LoRARequest]:
        """The adapters requests may name, by name."""
        with self._lock:
            return dict(self._named)

    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Load (and check) an adapter and serve it under its name. A name already
        served is refused (RequestError on lora_name): unload it first."""
        with self._lock:
            self._check_unused(request.lora_name)
        adapter = self._load(request)
        with self._lock:
            self._check_unused(request.lora_name)  # a concurrent load may have won it
            self._named[request.lora_name] = request
            self._keep(request, adapter)
        return adapter

    def _check_unused(self, name: str) -> None:
        if name in self._named:
            raise RequestError("lora_name", f"an adapter named {name!r} is already loaded")

    def unregister(self, name: str) -> bool:
        """Stop serving `name` (running requests keep their adapter); False if unknown."""
        with self._lock:
            request = self._named.pop(name, None)
            if request is not None:
                self._loaded.pop(request, None)
        return request is not None

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of a request's LoRARequest, loading it if it is not in
        memory (a LoRARequest never seen is loaded and served under its name)."""
        with self._lock:
            adapter = self._loaded.get(request)
            if adapter is not None:
                self._loaded.move_to_end(request)
                return adapter
            known = self._named.get(request.lora_name)
        if known is not None and known != request:
            raise RequestError(
                "lora_request",
                f"the adapter {request.lora_name!r} is served from {known.lora_path}, not "
                f"{request.lora_path} (id {known.lora_int_id})",
            )
        adapter = self._load(request)
        with self._lock:
            self._named.setdefault(request.lora_name, request)
            self._keep(request, adapter)
        return adapter

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        t0 = time.perf_counter()
        adapter = load_lora_adapter(
            request.lora_name, request.lora_path, self.model_config, self.max_rank
        )
        logger.info(
            "LoRA adapter %r loaded from %s in %.0f ms: rank %d, %d projections, %.1f MiB",
            adapter.name,
            adapter.path,
            (time.perf_counter() - t0) * 1e3,
            adapter.rank,
            len(adapter.modules),
            adapter.nbytes / 2**20,
        )
        return adapter

    def _keep(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
        """Hold `adapter` in memory, dropping the least recently used beyond the limit
        (under the lock)."""
        self._loaded[request] = adapter
        self._loaded.move_to_end(request)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)
