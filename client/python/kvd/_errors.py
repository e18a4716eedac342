"""kvd.KvdError: a failed daemon call, with the canonical gRPC status code name and the daemon's message."""

import grpc

# google.rpc.Code numbers (what the handle channel sends) -> names ("NOT_FOUND").
_CODE_NAMES = {sc.value[0]: sc.name for sc in grpc.StatusCode}


class KvdError(Exception):
    """A daemon call failed. `code` is the canonical status code name ("NOT_FOUND",
    "RESOURCE_EXHAUSTED", ...), `message` the daemon's message naming the field, pool or uid."""

    def __init__(self, code, message):
        if isinstance(code, grpc.StatusCode):
            code = code.name
        elif isinstance(code, int):
            code = _CODE_NAMES.get(code, "UNKNOWN")
        self.code = str(code)
        self.message = str(message)
        super().__init__(f"{self.code}: {self.message}")

    @classmethod
    def from_rpc(cls, error):
        """From a grpc.RpcError raised by a stub call."""
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code if code is not None else "UNKNOWN", details or "")
