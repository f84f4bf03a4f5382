"""What a sample is made of, as a source hands it to the dataset writer: ``Element`` (one plan record:
kind, flags, payload) and ``StoredImage`` (encoded bytes with what was probed), the vocabulary of
:mod:`mmidx.format`'s ELEMENT and IMAGE records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mmidx import format as fmt

KIND_CODES = {name: code for code, name in enumerate(fmt.KIND_NAMES)}


_FORMAT_CODES = {name: code for code, name in enumerate(fmt.IMAGE_FORMATS)}


_MODE_CODES = {name: code for code, name in enumerate(fmt.IMAGE_MODES)}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class Element:
    """One plan record of a view: what to put in the packed sequence, and how it is trained.

    ``payload`` is the number of a text (for ``kind="text"``) or of an image (for the image kinds)
    among the sample's own texts or images, so several elements may share one stored image.
    """

    kind: str
    payload: int
    loss: bool = False
    enable_cfg: bool = False
    special_token_loss: bool = False
    special_token_label: int | None = None
    split_start: bool = True
    split_end: bool = True
    frame_delta: int | None = None
    img_num: int = 1

    def record(self) -> tuple[int, int, int, int, int, int]:
        """The element as a tuple in ``ELEMENT_DTYPE`` field order (checked and kept on first use: views
        are usually the same few elements, sample after sample)."""
        record = self.__dict__.get("_record")
        if record is None:
            record = self._checked_record()
            object.__setattr__(self, "_record", record)  # not a field: equality and repr do not see it
        return record

    def _checked_record(self) -> tuple[int, int, int, int, int, int]:
        if self.kind not in KIND_CODES:
            raise ValueError(f"unknown element kind {self.kind!r}; use one of {fmt.KIND_NAMES}")
        flags = (
            fmt.FLAG_LOSS * bool(self.loss)
            | fmt.FLAG_ENABLE_CFG * bool(self.enable_cfg)
            | fmt.FLAG_SPECIAL_TOKEN_LOSS * bool(self.special_token_loss)
            | fmt.FLAG_SPLIT_START * bool(self.split_start)
            | fmt.FLAG_SPLIT_END * bool(self.split_end)
            | fmt.FLAG_HAS_FRAME_DELTA * (self.frame_delta is not None)
        )
        label = -1 if self.special_token_label is None else self.special_token_label
        if not 1 <= self.img_num <= 0xFFFF:
            raise ValueError(f"img_num must be at least 1 and fit uint16, not {self.img_num}")
        frame_delta = self.frame_delta or 0
        if not (_INT32_MIN <= frame_delta <= _INT32_MAX and _INT32_MIN <= label <= _INT32_MAX):
            raise ValueError("frame_delta and special_token_label must fit int32")
        return (KIND_CODES[self.kind], flags, self.img_num, frame_delta, label, self.payload)


class StoredImage(NamedTuple):
    """Encoded image bytes as they will be stored, with what probing them found."""

    data: bytes
    width: int
    height: int
    format: str = "unknown"
    mode: str = "unknown"
    has_transparency: bool = False

    def record(self) -> tuple[int, int, int, int, int, int]:
        """The image's ``IMAGE_DTYPE`` record."""
        if not (_INT32_MIN <= self.width <= _INT32_MAX and _INT32_MIN <= self.height <= _INT32_MAX):
            raise ValueError("image width and height must fit int32")
        return (self.width, self.height, _FORMAT_CODES.get(self.format, 0), _MODE_CODES.get(self.mode, 0),
                fmt.IMAGE_FLAG_TRANSPARENCY * bool(self.has_transparency), 0)
