"""The draft-tree shape: ``num_beams`` beams of ``draft_len_per_beam`` tokens each.

A tree holds at most ``num_beams * draft_len_per_beam`` draft tokens (ReDrafter arXiv 2403.09919
Sec. 3.2; TensorRT-LLM's ``redrafter_num_beams`` and ``redrafter_draft_len_per_beam``). Written
``BxD`` (``2x2``) in calibration files, command lines, stats and logs: parsed and formatted here only.
"""

from __future__ import annotations

from typing import NamedTuple


class DraftShape(NamedTuple):
    """``(num_beams, draft_len_per_beam)``; a tuple, so ``DraftShape(2, 3) == (2, 3)``."""

    num_beams: int
    draft_len_per_beam: int

    @classmethod
    def parse(cls, text: str) -> "DraftShape":
        """``"6x3"`` -> ``DraftShape(6, 3)``.

        Raises:
            ValueError: not ``NUM_BEAMSxDRAFT_LEN`` with both >= 1.
        """
        try:
            beams, draft = (int(x) for x in str(text).lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {text!r}: expected NUM_BEAMSxDRAFT_LEN, e.g. 2x2") from None
        if beams < 1 or draft < 1:
            raise ValueError(f"shape {text!r}: num_beams and draft_len_per_beam must be >= 1")
        return cls(beams, draft)

    @classmethod
    def parse_list(cls, text: str) -> list["DraftShape"]:
        """``"1x1,2x2"`` -> ``[DraftShape(1, 1), DraftShape(2, 2)]`` (command-line lists).

        Raises:
            ValueError: an empty list or a malformed shape (named).
        """
        shapes = [cls.parse(part.strip()) for part in str(text).split(",") if part.strip()]
        if not shapes:
            raise ValueError(f"shapes {text!r}: expected a comma-separated list such as 1x1,2x2")
        return shapes

    @property
    def size(self) -> int:
        """Draft tokens the tree holds at most: ``num_beams * draft_len_per_beam``."""
        return self.num_beams * self.draft_len_per_beam

    def __str__(self) -> str:
        return f"{self.num_beams}x{self.draft_len_per_beam}"


def shape_text(shape: tuple[int, int] | None) -> str | None:
    """``BxD`` of a shape, or None for plain decoding (no tree)."""
    return None if shape is None else str(DraftShape(*shape))
