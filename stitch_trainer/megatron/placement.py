"""`Placement`: where some rows of a local Megatron tensor land in one HF tensor.

A local tensor maps to HF tensors as a few placements (repeated row runs plus a column offset),
so positions are translated with integer arithmetic on whole tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Placement:
    """Where some rows of a local tensor land in one HF tensor.

    The local tensor is seen as ``(-1, cols)`` rows and the HF tensor as ``(-1, hf_cols)``
    (1-D tensors: one element per row). For run j < ``runs``, local rows
    ``local_row + j*local_stride + [0, rows)`` are HF rows ``hf_row + j*hf_stride + [0, rows)``,
    local column c being HF column ``col + c``. ``owned``: False for replicas (a replicated
    tensor on TP ranks > 0, a tied output layer), which are not counted.
    """

    hf_name: str
    hf_shape: tuple[int, ...]
    cols: int
    rows: int
    local_row: int = 0
    hf_row: int = 0
    runs: int = 1
    local_stride: int = 0
    hf_stride: int = 0
    col: int = 0
    owned: bool = True

    @property
    def hf_cols(self) -> int:
        return math.prod(self.hf_shape[1:])

    @property
    def numel(self) -> int:
        return self.runs * self.rows * self.cols

    def _rows(self, first: int, stride: int, device: Any = None) -> torch.Tensor:
        j = torch.arange(self.runs, device=device).unsqueeze(1) * stride
        return (first + j + torch.arange(self.rows, device=device)).reshape(-1)

    def local_rows(self, device: Any = None) -> torch.Tensor:
        """Local row indices, in HF order."""
        return self._rows(self.local_row, self.local_stride, device)

    def hf_rows(self, device: Any = None) -> torch.Tensor:
        return self._rows(self.hf_row, self.hf_stride, device)

    @property
    def local_contiguous(self) -> bool:
        return self.runs == 1 or self.local_stride == self.rows

    @property
    def hf_slice(self) -> tuple[int, int] | None:
        """(flat offset, numel) when the HF positions form one contiguous flat slice."""
        if (self.runs == 1 or self.hf_stride == self.rows) and self.cols == self.hf_cols:
            return self.hf_row * self.hf_cols, self.numel
        return None

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The local elements this placement covers, as ``(runs*rows, cols)`` in HF order (a view
        when the local rows are contiguous)."""
        v = local.reshape(-1, self.cols)
        if self.local_contiguous:
            return v[self.local_row : self.local_row + self.runs * self.rows]
        return v[self.local_rows(local.device)]

    def hf_positions(self, block_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Global HF flat positions of the covered elements (or of those in the HF rows
        ``block_rows``), in `gather` order; int64 ``(n, cols)``."""
        rows = self.hf_rows() if block_rows is None else block_rows
        c = torch.arange(self.col, self.col + self.cols, device=rows.device)
        return rows.unsqueeze(1) * self.hf_cols + c

    def map(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For local flat positions: (mask of those this placement covers, their HF positions)."""
        row, c = positions // self.cols, positions % self.cols
        rel = row - self.local_row
        j = rel // self.local_stride if self.runs > 1 else torch.zeros_like(rel)
        i = rel - j * self.local_stride
        mask = (rel >= 0) & (j < self.runs) & (i < self.rows)
        hrow = self.hf_row + j[mask] * self.hf_stride + i[mask]
        return mask, hrow * self.hf_cols + self.col + c[mask]

