"""The `ipc` data plane's releases: a reader done with a block's rows (its outcome is in)
publishes `{"block_id", "offset"}` on the arena's release subject (core NATS, no ack); the
capture frees that span if the block still holds it. A release that never comes (a reader
that died, a lost message) leaves the span to its block's expiry."""

from __future__ import annotations

import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from stateblock.model.arena import DeviceArena
from stateblock.protocol import streams

log = structlog.get_logger("capture_svc.releases")


async def serve_releases(nc: NATS, arena: DeviceArena) -> Subscription:
    """Free the spans the readers release, until the subscription is drained."""

    async def on_release(msg) -> None:
        try:
            block_id, offset = streams.parse_release(msg.data)
        except ValueError as e:  # not one of ours: nothing to free
            log.warning("malformed release", error=str(e), size=len(msg.data))
            return
        if not arena.free(offset, block_id):  # expired already, or a repeat
            log.debug("release of a span not held", block_id=block_id)

    return await nc.subscribe(streams.release_subject(arena.instance_id), cb=on_release)
