"""kvd.KvdError: a failed daemon call, with the canonical gRPC status code name and the daemon's message."""

# google.rpc.Code numbers -> names, as the C API (kvd_code_name) and the daemon spell them.
_CODE_NAMES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
               "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
               "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


class KvdError(Exception):
    """A daemon call failed. `code` is the canonical status code name ("NOT_FOUND",
    "RESOURCE_EXHAUSTED", ...), `message` the daemon's message naming the field, pool or uid."""

    def __init__(self, code, message):
        if isinstance(code, int) and not isinstance(code, bool):
            code = _CODE_NAMES[code] if 0 <= code < len(_CODE_NAMES) else "UNKNOWN"
        elif not isinstance(code, str) and hasattr(code, "name"):  # an enum of codes, e.g. grpc.StatusCode
            code = code.name
        self.code = str(code)
        self.message = str(message)
        super().__init__(f"{self.code}: {self.message}")

    @classmethod
    def from_rpc(cls, error):
        """From an RPC error with code() and details() (a grpc.RpcError, for callers that use gRPC themselves)."""
        code = error.code() if hasattr(error, "code") else "UNKNOWN"
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code if code is not None else "UNKNOWN", details or "")
