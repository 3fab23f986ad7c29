"""A readout worker's pull loop: one block at a time, and a long block parked beside it.

A long block's readout waits for its turn in the long runner (readout_svc.cohorts), one
long block an execution at a time; a loop that waited for it would pull nothing else, and
a process whose every loop holds a long block would read no short one meanwhile. So once a
block's readout is queued as a long block's, its handling goes on in a task of its own
(claim, lease keep-alive, commit and ack as ever) while the loop pulls the next block. A
loop parks one block at a time: with one parked, it handles the next block in hand to its
end, so a process holds at most twice its loops' blocks.
"""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from nats.aio.msg import Msg

from readout_svc.worker import ReadoutWorker
from registry import RegistryError

log = structlog.get_logger("readout_svc")


async def run_worker(
    worker: ReadoutWorker, psub, stop: asyncio.Event, *, fetch_timeout_s: float
) -> None:
    """Pull until `stop`; a block in hand (a parked one too) is always finished."""
    parked: asyncio.Task | None = None
    try:
        while not stop.is_set():
            for msg in await _fetch(worker, psub, fetch_timeout_s):
                if parked is not None and not parked.done():
                    await _handle(worker, msg, None)
                else:
                    parked = await _handle_or_park(worker, msg)
    finally:
        if parked is not None:
            await parked  # a cancel of the loop cancels it too, as it would a block in hand


async def _fetch(worker: ReadoutWorker, psub, fetch_timeout_s: float) -> list[Msg]:
    try:
        return await psub.fetch(1, timeout=fetch_timeout_s)
    except TimeoutError:  # nats' and asyncio's own: a fetch whose deadline passed while
        return []  # the loop was busy raises the latter, which must not end the loop
    except Exception as e:  # NATS trouble or a bug: the pull loop must outlive it
        log.warning("fetch failed", error=repr(e), worker_id=worker.worker_id)
        await asyncio.sleep(fetch_timeout_s)
        return []


async def _handle_or_park(worker: ReadoutWorker, msg: Msg) -> asyncio.Task | None:
    """Handle the block to its end, or until its readout is queued as a long block's: then
    the task still handling it."""
    long_read = asyncio.Event()
    task = asyncio.create_task(_handle(worker, msg, long_read))
    queued = asyncio.create_task(long_read.wait())
    try:
        await asyncio.wait({task, queued}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the loop is cancelled: so is the block, as one in hand
        task.cancel()
        raise
    finally:
        queued.cancel()
    return None if task.done() else task


async def _handle(worker: ReadoutWorker, msg: Msg, long_read: asyncio.Event | None) -> None:
    try:
        await worker.handle(msg, long_read)
    except (RegistryError, TimeoutError, nats.errors.Error) as e:
        # NATS trouble mid-block: no ack, so JetStream redelivers after ack_wait.
        log.warning("block left for redelivery", error=repr(e), worker_id=worker.worker_id)
    except Exception:  # a bug must not kill the pull loop; the block is redelivered
        log.exception("unexpected failure handling a block", worker_id=worker.worker_id)
