"""Long messages in small frames: a prompt or a receipt of any length, as PART frames first.

Theory of operation
-------------------
No frame grows with the prompt. A message whose token ids (or prompt text) do not fit one frame
(``control.IDS_PER_FRAME`` ids, ``control.TEXT_PER_FRAME`` characters) travels as leading
:class:`~swarm.proto.control.Part` frames, each with the next piece, then the message itself
with the last piece; the receiver's :class:`Assembler` joins them, bounded as a whole
(``MAX_PROMPT_IDS`` ids, ``MAX_TEXT`` characters) and checked piece by piece as they come, so
a sender cannot make it hold more than that. A request is then bounded by what the swarm's
context can hold (checked where it is served), never by a per-string or per-frame cap.

A receipt (``Done``) carries its prompt and output token ids the same way: out of the JSON
body (whose lists are capped at ``max_list`` entries) into the ids, with the prompt's length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from swarm.errors import ProtocolError
from swarm.proto.control import (
    IDS_PER_FRAME,
    MAX_PROMPT_IDS,
    MAX_TEXT,
    TEXT_PER_FRAME,
    Control,
    Done,
    Gen,
    Part,
)
from swarm.proto.frame import Frame
from swarm.proto.messages import Message

_SPLIT = "token_ids_split"  # a receipt on the wire: how many of its ids are the prompt's


def _pieces(seq: Any, size: int) -> list[Any]:
    return [seq[i : i + size] for i in range(0, len(seq), size)] or [seq[:0]]


def frames_of(msg: Control) -> list[Frame]:
    """``msg`` as the frames that carry it: PART frames (if it is long), then the message."""
    return [piece.to_frame() for piece in pieces_of(msg)]


def pieces_of(msg: Control) -> list[Control]:
    """``msg`` as the messages that carry it, one frame each: Parts (if it is long), then the
    message with the last piece."""
    if isinstance(msg, Done):
        receipt = dict(msg.receipt)
        prompt = [int(t) for t in receipt.pop("prompt_token_ids", ())]
        output = [int(t) for t in receipt.pop("output_token_ids", ())]
        receipt[_SPLIT] = len(prompt)
        msg = Done(receipt, ids=(*prompt, *output))
    ids: tuple[int, ...] = tuple(getattr(msg, "ids", ()))
    text = msg.text if isinstance(msg, Gen) and msg.text is not None else None
    id_pieces = _pieces(ids, IDS_PER_FRAME)
    text_pieces = _pieces(text or "", TEXT_PER_FRAME)
    n = max(len(id_pieces), len(text_pieces))
    id_pieces += [()] * (n - len(id_pieces))
    text_pieces += [""] * (n - len(text_pieces))
    pieces: list[Control] = [Part(ids=tuple(i), text=t) for i, t in zip(id_pieces[:-1], text_pieces[:-1], strict=True)]
    last: dict[str, Any] = {"ids": tuple(id_pieces[-1])}
    if text is not None:
        last["text"] = text_pieces[-1]
    whole = dataclasses.replace(msg, **last) if n > 1 else msg  # type: ignore[type-var]
    pieces.append(whole)
    return pieces


class Assembler:
    """Feed it each message of a stream in order: PART frames are held (within the bounds), the
    next message comes back whole; ProtocolError past a bound or for a part nothing follows."""

    def __init__(self, *, max_ids: int = MAX_PROMPT_IDS, max_text: int = MAX_TEXT) -> None:
        self.max_ids, self.max_text = max_ids, max_text
        self._ids: list[int] = []
        self._text: list[str] = []
        self._chars = 0

    @property
    def pending(self) -> bool:
        return bool(self._ids or self._chars)

    def feed(self, msg: Message) -> Message | None:
        if isinstance(msg, Part):
            self._take(msg.ids, msg.text)
            return None
        if not self.pending and not isinstance(msg, Done):
            return msg
        if isinstance(msg, Gen):
            self._take(msg.ids, msg.text or "")
            text = "".join(self._text) if msg.text is not None else None
            if msg.text is None and self._chars:
                raise ProtocolError("CONTROL gen: text parts before a request without text")
            whole: Message = dataclasses.replace(msg, ids=tuple(self._ids), text=text)
        elif isinstance(msg, Done):
            self._take(msg.ids, "")
            whole = _receipt(msg.receipt, self._ids)
        else:
            raise ProtocolError(f"CONTROL part: followed by {type(msg).__name__}, which carries no parts")
        self._ids, self._text, self._chars = [], [], 0
        return whole

    def _take(self, ids: tuple[int, ...], text: str) -> None:
        if len(self._ids) + len(ids) > self.max_ids:
            raise ProtocolError(f"CONTROL part: more than {self.max_ids} token ids in one message")
        if self._chars + len(text) > self.max_text:
            raise ProtocolError(f"CONTROL part: more than {self.max_text} characters of text in one message")
        self._ids.extend(ids)
        if text:
            self._text.append(text)
            self._chars += len(text)


def _receipt(body: dict[str, Any], ids: list[int]) -> Done:
    receipt = dict(body)
    split = receipt.pop(_SPLIT, None)
    if split is None:
        return Done(receipt)
    if isinstance(split, bool) or not isinstance(split, int) or not 0 <= split <= len(ids):
        raise ProtocolError(f"CONTROL done field '{_SPLIT}': {split!r}, expected 0..{len(ids)}")
    receipt["prompt_token_ids"], receipt["output_token_ids"] = ids[:split], ids[split:]
    return Done(receipt)
