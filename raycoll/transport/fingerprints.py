"""A collective's fingerprint (what every rank must agree on: the collective, shapes, dtype,
op, root) in the forms the native core compares: bytes (the node segment compares them whole,
and a mismatch's message decodes them back) and a 64-bit hash (the sockets' message headers
carry it). Cached per fingerprint: computed once per kind of call, not per call."""

from __future__ import annotations

import ast
import hashlib
from typing import Any, Dict, Tuple

__all__ = ["Fingerprints", "FP_BYTES", "all_reduce_fp"]

#: The most bytes of a fingerprint the segment compares (segment.h's RC_FP_BYTES); a longer
#: one is compared by its hash.
FP_BYTES = 192


def all_reduce_fp(dtype: str, shape: Tuple[int, ...], reduce_op: Any) -> Dict[str, Any]:
    """The fingerprint ``raycoll.all_reduce`` gives a CPU array's call (what its short paths
    must give alike, so that a rank on a short path meets a peer on the full one)."""
    return {"dtype": dtype, "shape": shape, "reduce_op": reduce_op, "device": "cpu",
            "op": "all_reduce"}


class Fingerprints:
    """A call's fingerprint as bytes (``repr`` of the sorted dict) and as a hash."""

    def __init__(self) -> None:
        self._cache: Dict[Any, Tuple[bytes, int]] = {}

    def _both(self, fp: Dict[str, Any]) -> Tuple[bytes, int]:
        try:
            key: Any = tuple(sorted(fp.items()))
            hash(key)
        except TypeError:  # an unhashable value: not cached
            key = None
        got = self._cache.get(key) if key is not None else None
        if got is None:
            blob = repr(dict(sorted(fp.items()))).encode()
            digest = hashlib.blake2b(blob, digest_size=32).digest()
            if len(blob) > FP_BYTES:
                blob = b"#" + digest
            got = (blob, int.from_bytes(digest[:8], "little"))
            if key is not None:
                if len(self._cache) > 1024:
                    self._cache.clear()
                self._cache[key] = got
        return got

    def encode(self, fp: Dict[str, Any]) -> bytes:
        """The bytes the node segment compares."""
        return self._both(fp)[0]

    def hash(self, fp: Dict[str, Any]) -> int:
        """The 64-bit hash the sockets' headers carry."""
        return self._both(fp)[1]

    @staticmethod
    def decode(blob: bytes) -> Dict[str, Any]:
        """The fingerprint back from :meth:`encode`'s bytes (for a mismatch's message)."""
        if blob.startswith(b"#"):
            return {"fingerprint": blob[1:9].hex()}
        try:
            value = ast.literal_eval(blob.decode())
            return value if isinstance(value, dict) else {"fingerprint": repr(value)}
        except (ValueError, SyntaxError, UnicodeDecodeError):
            return {"fingerprint": blob.hex()}
