"""Messages a proxy missed from a decode worker's batch publisher, asked for again.

A PUB socket drops messages for a subscriber that is behind (the publisher's or this proxy's
high-water mark); each message carries its publisher's ``epoch`` and a ``seq`` that counts up
by one, so a jump within one epoch is a gap. The publisher keeps the messages that carried
finished requests (``batch_publisher``): a gap is counted (``PublishedBatches.missed``) and the
messages it covers are asked for on the publisher's replay socket, at the PUB endpoint's host.
What comes back is handled before the message that showed the gap; what the publisher no
longer holds, or a replay that does not answer in time, is counted as lost
(``PublishedBatches.lost``) at once, not found out when the recorder gives up on an entry.
"""

from __future__ import annotations

import logging

import orjson
import zmq
import zmq.asyncio

from stages.capture.batch_publisher import BatchMessage, ReplayRequest

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 1.0


class GapFiller:
    """One decode worker's messages in order: ``missed`` returns those a gap skipped."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self._context = context
        self._host = endpoint.removeprefix("tcp://").rpartition(":")[0] if endpoint.startswith(
            "tcp://") else None
        self._epoch: str | None = None
        self._last = -1
        self._dealer: zmq.asyncio.Socket | None = None

    async def missed(self, message: BatchMessage) -> tuple[int, int, list[BatchMessage]]:
        """Before ``message``: how many messages were missed, how many of those are lost (not
        replayed), and the replayed ones that carried finished requests, oldest first."""
        epoch, last = self._epoch, self._last
        self._epoch, self._last = message.epoch, message.seq
        if epoch != message.epoch or not message.epoch or message.seq <= last + 1:
            return 0, 0, []  # in order, or the first message of a (restarted) publisher
        first, gap = last + 1, message.seq - last - 1
        if message.replay is None or self._host is None:
            return gap, gap, []
        answer = await self._ask(message.replay, ReplayRequest(message.epoch, first,
                                                               message.seq - 1))
        if answer is None:
            return gap, gap, []
        complete, replayed = answer
        # Messages the buffer kept are those that carried finished requests: with every one
        # since ``first`` still there, nothing is lost; otherwise which ones were, is unknown.
        return gap, 0 if complete else gap - len(replayed), replayed

    async def _ask(self, port: int, ask: ReplayRequest) -> tuple[bool, list[BatchMessage]] | None:
        if self._dealer is None:
            self._dealer = self._context.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            if self._host is not None and self._host.startswith("["):
                self._dealer.setsockopt(zmq.IPV6, 1)
            self._dealer.connect(f"tcp://{self._host}:{port}")
        dealer = self._dealer
        await dealer.send(ask.encode())
        if not await dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
            log.warning("the batch publisher at %s:%d did not replay messages %d-%d in %g s",
                        self._host, port, ask.first, ask.last, REPLAY_TIMEOUT_S)
            # A late answer must not be read as the next one's.
            self.close()
            return None
        header, *raws = await dealer.recv_multipart()
        try:
            complete = orjson.loads(header).get("complete") is True
            return complete, [BatchMessage.decode(raw) for raw in raws]
        except (orjson.JSONDecodeError, AttributeError, ValueError) as exc:
            log.warning("the batch publisher at %s:%d replayed what cannot be read: %s",
                        self._host, port, exc)
            return None

    def close(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
