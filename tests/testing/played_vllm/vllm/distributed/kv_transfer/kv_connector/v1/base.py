"""Played: KVConnectorBase_V1 with its abstract methods and the worker-side get_mem_pool_context (vLLM #53508)."""
import enum
import os
from abc import ABC, abstractmethod


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._vllm_config, self._role, self._kv_cache_config = vllm_config, role, kv_cache_config

    def register_kv_caches(self, kv_caches):
        return

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs): ...

    @abstractmethod
    def wait_for_layer_load(self, layer_name): ...

    @abstractmethod
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs): ...

    @abstractmethod
    def wait_for_save(self): ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens): ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...


if os.environ.get("PLAYED_VLLM_NO_MEM_POOL_CONTEXT") != "1":
    def _get_mem_pool_context(self):
        return None

    KVConnectorBase_V1.get_mem_pool_context = _get_mem_pool_context
