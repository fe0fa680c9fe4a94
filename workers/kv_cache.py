"""Per-sequence KV cache with scratch slots for draft-tree verification.

The cache holds ``batch`` rows; each row is one sequence with ``max_len`` slots. Committed
tokens occupy slots ``[0, lengths[b])``. During ReDrafter verification the packed draft tree is
written to the scratch slots after the committed prefix; :meth:`KVCache.commit_path` then copies
the accepted path into place, so rejected tokens leave no trace (ReDrafter arXiv 2403.09919
Sec. 3.3; TensorRT-LLM calls this "KV cache rewind").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where one forward's new tokens go in the cache and what they may attend to.

    rows, slots: ``[B, T] long`` cache row and slot of each new token.
    mask: ``[B, 1, T, kv_len] bool``; True where query token t may attend to slot s.
    kv_len: number of leading slots attention reads.
    row_ids: cache rows of the B batch entries; ``None`` means rows ``0..B-1`` of a cache with B rows.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    kv_len: int
    row_ids: torch.Tensor | None = None


class KVCache:
    """Keys and values ``k[layer], v[layer]: [batch, max_len, n_kv_heads, head_dim]``.

    Slot-major rows make writing scattered slots one ``index_copy_`` on a flat view; attention
    reads a transposed view.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * batch
        self.max_len = max_len
        self.device = torch.device(device)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values.

        rows, slots: ``[B, T] long`` cache row and slot of each new token.
        k, v: ``[B, n_kv_heads, T, head_dim]``.
        """
        index = (rows * self.max_len + slots).reshape(-1)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            flat = cache.view(-1, cache.shape[2], cache.shape[3])
            flat.index_copy_(0, index, new.transpose(1, 2).reshape(-1, cache.shape[2], cache.shape[3]))

    def read(self, layer: int, row_ids: torch.Tensor | None, kv_len: int):
        """Keys and values ``[B, n_kv_heads, kv_len, head_dim]`` of the given rows."""
        k, v = self.k[layer][:, :kv_len], self.v[layer][:, :kv_len]
        if row_ids is not None:
            k, v = k[row_ids], v[row_ids]
        return k.transpose(1, 2), v.transpose(1, 2)

    def commit_path(self, row: int, start: int, node_indices: list[int]) -> None:
        """Move the accepted tree nodes (written at ``start + node_indices[i]``) to
        ``start + i`` and extend the row's committed length by ``len(node_indices)``.

        Raises:
            ValueError: if the path would run past ``max_len``.
        """
        n = len(node_indices)
        if start + n > self.max_len:
            raise ValueError(f"KV cache row {row} overflows max_len={self.max_len}")
        if node_indices != list(range(n)):
            src = torch.tensor(node_indices, device=self.device) + start
            for cache in (self.k, self.v):
                for layer in cache:
                    layer[row, start : start + n] = layer[row, src]
        self.lengths[row] = start + n
