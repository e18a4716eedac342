"""kvd_vllm: vLLM's KV cache on kvd through vLLM's own plugin seams, without patching vLLM (docs/engines.md, "vLLM").

The `vllm.general_plugins` entry point `kvd` (pyproject.toml) calls register() in every vLLM process, which registers
- the sleep-mode backend "kvd" (vllm.device_allocator.sleep_mode_backend.SleepModeBackendFactory, vllm-project/vllm
  #44074): sleep, wake and the KV-only release (release_kv_cache_memory -> discard(("kv_cache",))) of the KV cache are
  kvd sleeps and wakes of its pools, through the allocator's own session; weights and every other tag stay with vLLM's
  CuMem backend, which it wraps (kvd_vllm.backend);
- the KV connector "KvdConnector" (KVConnectorFactory), whose get_mem_pool_context() is the KV allocation context that
  vLLM enters only around the raw KV allocation (#53508): torch.cuda.use_mem_pool over kvd.torch's MemPool, so each
  KV cache tensor vLLM allocates is a kvd pool (kvd_vllm.connector, kvd_vllm.memory).

    vllm serve MODEL --enable-sleep-mode --sleep-mode-backend kvd \\
        --kv-transfer-config '{"kv_connector": "KvdConnector", "kv_role": "kv_both"}'

register() refuses a vLLM outside SUPPORTED, or one that lacks either seam, with an error saying which; set
KVD_VLLM_ALLOW_UNTESTED=1 to register anyway on a version this package was not written against.
"""

import os
import re

# The vLLM releases (major, minor) whose seams this package was written against: the sleep-mode backend factory is in
# v0.26.0; the KV allocation context (#53508) and KVConnectorBase_V1.get_mem_pool_context after it.
SUPPORTED = ((0, 26), (0, 29))  # [first, past-the-last)
ALLOW_UNTESTED_ENV = "KVD_VLLM_ALLOW_UNTESTED"
BACKEND_NAME = "kvd"
CONNECTOR_NAME = "KvdConnector"


def check_version(version):
    """Raises RuntimeError unless `version` ("0.27.1", "0.28.0rc2.dev5+g...") is in SUPPORTED."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None:
        raise RuntimeError(f"kvd_vllm: cannot read vLLM's version {version!r}")
    have = (int(m.group(1)), int(m.group(2)))
    first, past = SUPPORTED
    if not first <= have < past and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(f"kvd_vllm supports vLLM {first[0]}.{first[1]} up to (not including) {past[0]}.{past[1]}; "
                           f"this is vLLM {version}. Use a supported vLLM, or set {ALLOW_UNTESTED_ENV}=1 to register "
                           "the kvd sleep-mode backend and KvdConnector on it untested")


def register():
    """The vllm.general_plugins entry point: checks the version and both seams, then registers the backend and the
    connector (once per process; vLLM calls general plugins in every process it starts)."""
    import vllm  # noqa: PLC0415
    check_version(getattr(vllm, "__version__", "unknown"))
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory  # noqa: PLC0415
    except ImportError as e:
        raise RuntimeError(f"kvd_vllm: vLLM {vllm.__version__} has no pluggable sleep-mode backend "
                           f"(vllm.device_allocator.sleep_mode_backend, vllm-project/vllm#44074): {e}") from None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: PLC0415
    if not hasattr(KVConnectorBase_V1, "get_mem_pool_context"):
        raise RuntimeError(f"kvd_vllm: vLLM {vllm.__version__}'s KV connectors cannot provide the KV allocation "
                           "context (KVConnectorBase_V1.get_mem_pool_context, vllm-project/vllm#53508)")
    if BACKEND_NAME not in getattr(SleepModeBackendFactory, "_registry", {}):
        SleepModeBackendFactory.register_backend(BACKEND_NAME, "kvd_vllm.backend", "KvdSleepModeBackend")
    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvd_vllm.connector", "KvdConnector")
