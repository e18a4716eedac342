"""A played vLLM for kvd_vllm's tests (tests/client/python/kvd_vllm_test.py): vLLM cannot be installed here, so these
modules reproduce -- names, signatures, registries, call order -- the seams kvd_vllm plugs into, as read in
vllm-project/vllm: the sleep-mode backend factory (vllm/device_allocator/sleep_mode_backend.py, #44074) and the KV
connector base and factory (vllm/distributed/kv_transfer/kv_connector/). Nothing else of vLLM is here. Written for
the test, not copied; $PLAYED_VLLM_VERSION plays other versions."""
import os

__version__ = os.environ.get("PLAYED_VLLM_VERSION", "0.27.0")
