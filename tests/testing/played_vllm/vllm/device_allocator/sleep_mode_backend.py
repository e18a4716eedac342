"""Played: the sleep-mode backend interface and its factory (vLLM #44074). CuMemBackend plays vLLM's CuMem allocator
for the weights: it records what it was asked (there are no weights on the host)."""
import importlib
from abc import ABC, abstractmethod

CUMEM_CALLS = []  # (method, args) the played CuMem backend got


class SleepModeBackend(ABC):
    def __init__(self):
        self._state = "RUNNING"

    @abstractmethod
    def suspend(self, level=1):
        raise NotImplementedError

    @abstractmethod
    def resume(self, tags=None):
        raise NotImplementedError

    def state(self):
        return self._state

    def discard(self, tags):
        raise RuntimeError(f"Sleep-mode backend {type(self).__name__!r} does not support selective discard.")

    @classmethod
    def is_supported(cls):
        return True

    @classmethod
    def preserves_communicators(cls):
        return False


class CuMemBackend(SleepModeBackend):
    def suspend(self, level=1):
        CUMEM_CALLS.append(("suspend", level))
        self._state = "SUSPENDED"

    def resume(self, tags=None):
        CUMEM_CALLS.append(("resume", tags))
        self._state = "RUNNING"

    def discard(self, tags):
        CUMEM_CALLS.append(("discard", tuple(tags)))
        self._state = "SUSPENDED"


class SleepModeBackendFactory:
    _registry = {}

    @classmethod
    def register_backend(cls, name, module_path, class_name):
        if name in cls._registry:
            raise ValueError(f"Sleep-mode backend '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def get_backend_class(cls, name):
        if name not in cls._registry:
            raise ValueError(f"Unsupported sleep-mode backend '{name}'. Registered backends: "
                             f"{', '.join(sorted(cls._registry)) or '<none>'}.")
        return cls._registry[name]()

    @classmethod
    def create_backend(cls, model_config):
        backend_cls = cls.get_backend_class(model_config.sleep_mode_backend)
        if not backend_cls.is_supported():
            raise ValueError("not supported")
        return backend_cls()


SleepModeBackendFactory.register_backend("cumem", __name__, "CuMemBackend")
