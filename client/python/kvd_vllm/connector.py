"""KvdConnector: a KV connector that transfers nothing and provides the KV allocation context (vllm-project/vllm#53508):
vLLM calls get_mem_pool_context() in each worker before it allocates the KV cache and enters the context only around
that allocation."""

import logging

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from . import memory

_log = logging.getLogger("kvd_vllm")


class KvdConnectorMetadata(KVConnectorMetadata):
    pass


class KvdConnector(KVConnectorBase_V1):
    # -- worker side ---------------------------------------------------------------------------------------------------
    def get_mem_pool_context(self):
        return memory.kv_cache_allocation_context()

    def register_kv_caches(self, kv_caches):
        """Says which KV tensors are kvd memory, and which were adopted (Note [Re-attaching an allocation])."""
        alloc = memory.allocator()
        for name, tensor in kv_caches.items():
            for t in tensor if isinstance(tensor, (list, tuple)) else (tensor,):
                try:
                    adopted = alloc.adopted(t)
                except Exception as e:  # noqa: BLE001 (a tensor outside kvd: reported, not fatal)
                    _log.warning("kvd_vllm: KV cache %s is not in kvd memory: %s", name, e)
                    continue
                _log.debug("kvd_vllm: KV cache %s in kvd memory%s", name, " (adopted)" if adopted else "")

    def start_load_kv(self, forward_context, **kwargs):
        return None

    def wait_for_layer_load(self, layer_name):
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return None

    def wait_for_save(self):
        return None

    # -- scheduler side: nothing to load or save -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return None

    def build_connector_meta(self, scheduler_output):
        return KvdConnectorMetadata()
