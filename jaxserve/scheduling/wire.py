"""Whole messages over one connected socket, in order: the framing of the engine's link (`scheduling/link.py`).

A message is a pickled header (protocol 5) whose numpy arrays travel out of
band after it, each array copied once into the socket and once out of it:
a large message is read straight into one buffer its arrays then use; a
small one (64 KiB or less) lands in a staging buffer that batches reads of
small messages, and is copied out of it once more. Small messages posted in
one turn of the event loop go out as one write (`Wire.post`). Only
jaxserve's own processes speak on the socket (`http/workers.py` puts it in a
directory only this user may open), so unpickling its messages runs no code
another wrote.
"""

from __future__ import annotations

import asyncio
import collections
import pickle
import socket
import struct

PREFIX = struct.Struct("<IIQ")  # header bytes, buffers, their bytes; then each buffer's length (<Q), the header, them
JOIN_BYTES = 64 * 2**10  # a message whose arrays hold less than this goes out as one write (a copy costs less)
STAGE_BYTES = 256 * 2**10  # reads of small messages land here, several at a time
DIRECT_BYTES = 64 * 2**10  # a message larger than this is read into a buffer of its own (no second copy)


class Wire(asyncio.BufferedProtocol):
    """One connected socket: whole messages in and out, in order. An asyncio protocol over the loop's transport
    (uvloop's, in C): a write goes to the socket at once, or waits in the transport's buffer, with no task or
    future per message; reads land in a staging buffer, and a message over `DIRECT_BYTES` is read straight into a
    buffer of its own, which its arrays then use. Open one with `await Wire.open(sock)`; each message received goes
    to the function given to `deliver_to` as it arrives (no task wakes per message); `wait_closed` waits for the
    other side to go."""

    def __init__(self):
        self._transport: asyncio.Transport | None = None
        self._outbox: list[dict] = []
        self._flush_due = False
        self._received: collections.deque[dict] = collections.deque()
        self._on_message = None  # (message) -> None, called as each arrives (`deliver_to`); until then, `_received`
        self._waiter: asyncio.Future | None = None
        self._writable: asyncio.Future | None = None  # set while the transport asks writers to pause
        self._closed: Exception | None = None
        self._stage = bytearray(STAGE_BYTES)
        self._staged = 0  # bytes in the staging buffer
        self._body: memoryview | None = None  # a large message being read straight into its own buffer
        self._body_got = 0
        self._body_shape = (0, 0)  # its (buffers, header bytes)

    @classmethod
    async def open(cls, sock: socket.socket) -> Wire:
        wire = cls()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: wire, sock)
        return wire

    # ---- out ----

    def post(self, message: dict, nbytes: int = 0) -> None:
        """Send `message` (its arrays holding `nbytes`): a small one with the others posted in this turn of the
        event loop, as one (a batch's replies, a burst of requests: one write and one read for all of them, not
        one each); a large one at once, after those. A broken connection surfaces to the reader, not here."""
        if nbytes >= JOIN_BYTES:
            self.flush()
            self._write(message)
            return
        self._outbox.append(message)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what was posted in this turn now (as one message)."""
        self._flush_due = False
        if self._outbox:
            messages, self._outbox = self._outbox, []
            self._write(messages[0] if len(messages) == 1 else {"op": "many", "messages": messages})

    async def send(self, message: dict) -> None:
        """Send `message` now (after what was posted); waits while the transport's buffer is full."""
        if self._closed is not None:
            raise ConnectionError(f"the link is closed ({self._closed})")
        self.flush()
        self._write(message)
        if self._writable is not None:
            await asyncio.shield(self._writable)

    def _write(self, message: dict) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        size = sum(v.nbytes for v in views)
        prefix = PREFIX.pack(len(head), len(views), size) + b"".join(struct.pack("<Q", v.nbytes) for v in views)
        if size < JOIN_BYTES:
            self._transport.write(b"".join((prefix, head, *views)))
        else:
            for piece in (prefix + head, *views):  # write() each: asyncio's writelines never pauses a writer
                self._transport.write(piece)

    # ---- in ----

    def deliver_to(self, on_message) -> None:
        """From now on, each message (and those received before) goes to `on_message(message)` on arrival, in the
        protocol's own callback: no future or task wake-up per message."""
        self._on_message = on_message
        while self._received:
            on_message(self._received.popleft())

    async def wait_closed(self) -> None:
        """Until the other side has gone (or this end closed); then ConnectionError."""
        while self._closed is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        raise ConnectionError(f"the other process closed the link ({self._closed})")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._body_got :]
        if self._staged == len(self._stage):  # never: after each read it holds at most part of one small message
            raise AssertionError("staging buffer full")
        return memoryview(self._stage)[self._staged :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._body_got += nbytes
            if self._body_got == len(self._body):
                body, self._body = self._body, None
                self._deliver(self._decode(body, *self._body_shape))
            return
        self._staged += nbytes
        stage, at = memoryview(self._stage), 0
        while self._staged - at >= PREFIX.size:
            head_bytes, count, size = PREFIX.unpack_from(stage, at)
            length = 8 * count + head_bytes + size  # after the prefix
            start = at + PREFIX.size
            have = self._staged - start
            if have >= length and length <= DIRECT_BYTES:  # whole and small: copied out of the staging buffer
                self._deliver(self._decode(memoryview(bytearray(stage[start : start + length])), count, head_bytes))
                at = start + length
                continue
            if length > DIRECT_BYTES:  # large: the rest goes straight into its own buffer (arrays use it as is)
                body = memoryview(bytearray(length))
                got = min(have, length)
                body[:got] = stage[start : start + got]
                at = start + got
                if got == length:
                    self._deliver(self._decode(body, count, head_bytes))
                    continue
                self._body, self._body_got, self._body_shape = body, got, (count, head_bytes)
            break
        if at:
            stage[: self._staged - at] = stage[at : self._staged]
            self._staged -= at

    @staticmethod
    def _decode(body: memoryview, count: int, head_bytes: int) -> dict:
        sizes = struct.unpack_from(f"<{count}Q", body)
        at = 8 * count + head_bytes
        head, buffers = body[8 * count : at], []
        for n in sizes:
            buffers.append(body[at : at + n])
            at += n
        return pickle.loads(head, buffers=buffers)

    def _deliver(self, message: dict) -> None:
        if self._on_message is None:  # before `deliver_to`: kept for it
            self._received.append(message)
        else:
            self._on_message(message)

    # ---- the transport's calls ----

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        self._closed = self._closed or exc or ConnectionError("closed")
        for future in (self._waiter, self._writable):
            if future is not None and not future.done():
                future.set_result(None)
        self._writable = None

    def eof_received(self) -> bool:
        return False  # close the transport: the other side is gone

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    def close(self) -> None:
        """Close this end; whoever waits on it (`wait_closed`, a `send` held by a full buffer) wakes now, not when the
        transport has flushed, which a peer that stopped reading would never let happen."""
        if self._transport is not None:
            self._transport.close()
        self.connection_lost(None)
