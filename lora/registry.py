"""The adapters loaded for one model (the target, or a draft model with adapters of its own).

Loaded adapters are kept on the host, least recently used first, up to `capacity`; past it the
least recently used ones that no request holds are forgotten. A request holds the adapter object
it started with, so replacing or unloading a name never changes the weights of requests in
flight: an adapter leaves its device slot only once no request holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from lora.batch import LoRASlots

if TYPE_CHECKING:
    from engine.models.config import ModelConfig


class AdapterRegistry:
    """param: the request field that names this model's adapters, for error messages;
    slots: the model's device slots (None: the engine was built without enable_lora);
    in_use: ids of the adapter objects requests hold now."""

    def __init__(
        self,
        param: str,
        cfg: ModelConfig,
        max_rank: int,
        capacity: int,
        slots: LoRASlots | None,
        in_use: Callable[[], set[int]],
    ):
        self.param, self.cfg, self.max_rank, self.capacity = param, cfg, max_rank, capacity
        self.slots = slots
        self._in_use = in_use
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded)

    def cache_keys(self) -> dict[str, bytes]:
        """Loaded adapters' prefix-cache keys by name (what a replica router matches with)."""
        return {name: adapter.cache_key for name, adapter in self._loaded.items()}

    def load(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter a request names, loaded now or found loaded. Loading a name again from
        another path replaces it."""
        if self.slots is None:
            raise ValueError(f"{self.param} needs an engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"{self.param} must be a LoRARequest, got {lora_request!r:.80}")
        loaded = self._loaded
        current = loaded.get(lora_request.name)
        if current is None or current.path != str(lora_request.path):
            current = load_adapter(lora_request, self.cfg, self.max_rank)
            loaded[lora_request.name] = current
        loaded.move_to_end(lora_request.name)
        in_use = self._in_use() | {id(current)}  # the caller is about to hold it
        for name in [n for n, a in loaded.items() if id(a) not in in_use]:
            if len(loaded) <= self.capacity:
                break
            self.unload(name)
        return current

    def unload(self, name: str) -> None:
        """Forget an adapter. Requests in flight with it finish with it (they hold its weights);
        new requests must load it again."""
        adapter = self._loaded.pop(name, None)
        if adapter is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        if id(adapter) not in self._in_use():
            self.slots.evict(adapter)
