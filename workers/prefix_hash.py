"""Block hashes for automatic prefix caching: a chain of content hashes over a prompt's full KV blocks.

Block ``i`` covers token positions ``[i * block_size, (i + 1) * block_size)``; its hash covers its token
ids and its parent's hash (vLLM's scheme), so equal hashes mean equal whole prefixes, not just equal
blocks. The first block's hash also covers the request's ``cache_salt`` (vLLM's name): requests share
cached blocks only when their salts are equal. The model is fixed per engine, so it is not hashed.

BLAKE2b (16-byte digests) rather than Python's ``hash``: stable across processes and runs, so a router
in another process can hash a prompt the same way. Plain data, no torch.
"""

from __future__ import annotations

import hashlib
import struct

DIGEST_SIZE = 16


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                 num_blocks: int | None = None) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block has none), at most
    ``num_blocks`` of them."""
    n = len(token_ids) // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    parent = hashlib.blake2b((cache_salt or "").encode(), digest_size=DIGEST_SIZE).digest()
    out = []
    for i in range(n):
        block = token_ids[i * block_size: (i + 1) * block_size]
        parent = hashlib.blake2b(parent + struct.pack(f"<{block_size}q", *block), digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out
