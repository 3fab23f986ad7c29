"""Gateway logic: assign the request id, capture, wait for the commit, decode.

One base forward and one readout per request; there is no autoregressive path to fall
back to, so a request that cannot be read out fails with a `GatewayError`. No transport
here: HTTP and gRPC each turn their request into checked `GenerateParams`
(gateway/params.py), call `generate` and render its `Generation`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import structlog

from gateway import params
from gateway.capture_client import CaptureResult
from gateway.config import GatewayConfig
from gateway.errors import (
    BlockRejected,
    DeadlineExceeded,
    GatewayError,
    InvalidRequest,
    ReadoutFailed,
    Unavailable,
)
from gateway.generation import ChoiceResult, Generation, Piece, TokenLogprob
from gateway.idempotency import KeyStore, OwnedKey, Record, claim_or_follow, store_key
from gateway.metrics import GatewayMetrics
from gateway.params import GenerateParams
from gateway.stops import StopSpec, apply_stops
from registry import CommitTimeout, RegistryError
from stateblock import runtime
from stateblock.protocol import sampling
from stateblock.protocol.ids import uuid7
from stateblock.protocol.sampling import NO_EOS, Limits
from stateblock.v1 import block_pb2, capture_pb2, commit_pb2

log = structlog.get_logger("gateway")
MAX_STREAM_CHUNKS = 64  # bounds the prefix re-decoding a stream costs
# An answer this long is decoded on a thread (the tokenizers library lets go of the GIL): a
# maximal one, 8 lanes of 8,192 tokens, takes 20-40 ms, which on the event loop would hold
# up every other request this gateway serves; a short one costs less than the thread hop.
OFF_LOOP_TOKENS = 4096
# Rejection reasons that are not the request's own: its rows' object lost from the store,
# its block expired before any worker could claim it, its rows lost from their slot or
# region (the local and host data planes: freed, reused, gone). A fresh capture can be
# answered. Rows that do not match their signed digest are not among them.
RECAPTURED = frozenset({"object_missing", "expired", "rows_missing"})
MAX_RECAPTURES = 2
# Reasons that describe the request itself, which its client can change: a 400.
REQUEST_REASONS = frozenset({"limits"})
# an edge's request conversion, ending in `params.check` against what is served
Convert = Callable[[params.Served], GenerateParams]


CANCEL_TIMEOUT_S = 2.0  # how long a gone client's capture cancel may take to be delivered


class CaptureClient(Protocol):
    async def capture(
        self, request: capture_pb2.CaptureRequest, *, timeout: float
    ) -> CaptureResult: ...

    async def cancel(self, request_id: str, *, timeout: float) -> bool: ...


class CommitSource(Protocol):
    async def watch_commit(self, block_id: str, timeout: float) -> commit_pb2.Commit: ...


def fingerprint(p: GenerateParams, max_tokens: int) -> str:
    """One request's parameters, for `Idempotency-Key`: the same key with others is refused."""
    h = hashlib.sha256()
    h.update(repr((p.model, p.inputs, p.n, max_tokens, p.stop)).encode())
    h.update(p.sampling.SerializeToString(deterministic=True))
    return h.hexdigest()


@contextmanager
def _in(gauge) -> Iterator[None]:
    """Count a request in the gauge while the block runs."""
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


class GatewayService:
    def __init__(
        self,
        capture: CaptureClient,
        commits: CommitSource,
        tokenizer,
        metrics: GatewayMetrics,
        *,
        config: GatewayConfig,
        default_max_tokens: int,
        fingerprint: str = "",
        idempotency: KeyStore | None = None,
        decoder_digest: str = "",
    ) -> None:
        self._capture, self._commits, self._keys = capture, commits, idempotency
        self._tok, self._m, self._config = tokenizer, metrics, config
        self.vocab_size = len(tokenizer)  # every token id of a request is below it
        self.default_max_tokens = default_max_tokens
        self.decoder_digest, self._fingerprint = decoder_digest, fingerprint

    @property
    def model_name(self) -> str:
        return self._config.model_name

    @property
    def limits(self) -> Limits:
        return self._config.limits

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: the decoder's digest, which fixes what a seed reads."""
        return self._fingerprint

    def lanes(self, p: GenerateParams, max_tokens: int) -> list[capture_pb2.CaptureLane]:
        """n lanes per input, inputs in order; choice index = input * n + copy."""
        out = []
        for spec in p.inputs:
            for copy in range(p.n):
                lane = capture_pb2.CaptureLane(
                    sampling=sampling.with_seed_offset(p.sampling, copy), max_tokens=max_tokens
                )
                if spec.token_ids is not None:
                    lane.tokens.ids.extend(spec.token_ids)
                elif spec.messages is not None:
                    lane.chat.SetInParent()  # a chat, even an empty one, is the input
                    lane.chat.messages.extend(
                        capture_pb2.ChatMessage(role=r, content=c) for r, c in spec.messages
                    )
                else:
                    lane.prompt = spec.prompt or ""
                out.append(lane)
        return out

    async def generate(
        self,
        convert: Convert,
        *,
        api: str,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> Generation:
        """The answer to the request `convert` (an edge's conversion, given what this
        gateway serves) makes; it runs within the request's accounting, so a request it
        refuses is counted and logged as a failed one."""
        t0 = time.perf_counter()
        request_id = uuid7()
        m, model = self._m, self._m.model_name
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                generation = await self._generate(convert, request_id, timeout, idempotency_key)
            except asyncio.CancelledError:  # the client went away
                m.requests.labels(api, "Cancelled").inc()
                log.info("request cancelled: its caller went away")
                raise
            except GatewayError as e:
                outcome = type(e).__name__
                m.requests.labels(api, outcome).inc()
                m.e2e.labels(model, outcome).observe(time.perf_counter() - t0)
                log.info("request failed", error=outcome, detail=str(e))
                raise
            seconds = time.perf_counter() - t0
            m.requests.labels(api, "ok").inc()
            m.e2e.labels(model, "ok").observe(seconds)
            m.ttft.labels(model).observe(seconds)  # the whole block arrives at once
            m.prompt_tokens.labels(model).inc(generation.prompt_tokens)
            m.generation_tokens.labels(model).inc(generation.completion_tokens)
            for choice in generation.choices:
                m.success.labels(model, choice.finish_reason).inc()
            return generation

    async def _generate(
        self, convert: Convert, request_id: str, timeout: float | None, key: str | None
    ) -> Generation:
        p = convert(self)
        max_tokens = p.max_tokens  # resolved by the conversion's check
        loop = asyncio.get_running_loop()
        budget = (
            self._config.request_timeout_s
            if timeout is None
            else min(timeout, self._config.request_timeout_s)
        )
        deadline = loop.time() + budget
        lanes = self.lanes(p, max_tokens)
        if key is None:
            return await self._run(p, request_id, lanes, deadline, budget, None)
        if self._keys is None:
            raise InvalidRequest("This gateway keeps no idempotency keys.", "Idempotency-Key")
        stored = store_key(p.model, key)
        mine = Record(request_id, fingerprint(p, max_tokens), expires_at=time.time() + budget)
        action, found = await claim_or_follow(self._keys, stored, mine, deadline)
        while action == "follow":  # a retry: the first request's block, never a second run
            captured = CaptureResult(found.block_id, found.prompt_tokens)
            try:
                with _in(self._m.running.labels(self._m.model_name)):
                    return await self._answer(p, found.request_id, captured, deadline, budget)
            except BlockRejected as e:
                if e.reason in RECAPTURED:  # its owner captures it again: follow the new block
                    action, found = await claim_or_follow(
                        self._keys, stored, mine, deadline, stale_block=found.block_id
                    )
                else:
                    # the first run ended in a signed rejection (out of deliveries, the
                    # readout failing): no answer was ever given, so the key may run it anew
                    action, found = "run", await self._retake(stored, found, mine)
        owned = OwnedKey(self._keys, stored, mine, found)
        return await self._run(p, request_id, lanes, deadline, budget, owned)

    async def _run(
        self,
        p: GenerateParams,
        request_id: str,
        lanes: list[capture_pb2.CaptureLane],
        deadline: float,
        budget: float,
        key: OwnedKey | None,
    ) -> Generation:
        """Capture, then the answer. A block rejected for a reason not the request's own
        (RECAPTURED) is captured again as a new block, MAX_RECAPTURES times at most within
        the deadline, under the same client-visible request id and key: the capture's plan
        table refuses a request id twice, so each attempt has a capture id of its own."""
        loop, model = asyncio.get_running_loop(), self._m.model_name
        capture_id = request_id
        for attempt in range(MAX_RECAPTURES + 1):
            request = capture_pb2.CaptureRequest(request_id=capture_id, model=p.model, lanes=lanes)
            call = asyncio.ensure_future(
                self._capture.capture(request, timeout=deadline - loop.time())
            )
            try:
                with _in(self._m.waiting.labels(model)):
                    captured = await asyncio.shield(call)
            except asyncio.CancelledError:  # the client went away: settle what its capture did
                await asyncio.shield(self._abandon(call, capture_id, key, attempt))
                raise
            except (Unavailable, InvalidRequest):
                if key is not None:  # a first capture that never ran gives the key back at
                    # once: a retry runs it anew
                    await asyncio.shield(key.give_back() if attempt == 0 else key.lapse())
                raise
            if key is not None:  # published: a retry follows it, even past a client's cancel
                await asyncio.shield(key.point_to(captured.block_id, captured.prompt_tokens))
            try:
                with _in(self._m.running.labels(model)):
                    return await self._answer(p, request_id, captured, deadline, budget)
            except BlockRejected as e:
                again = e.reason in RECAPTURED and attempt < MAX_RECAPTURES
                if not again or loop.time() >= deadline:
                    if key is not None and e.reason in RECAPTURED:
                        await key.lapse()
                    raise
                self._m.recaptures.labels(e.reason).inc()
                capture_id = uuid7()
                log.warning("rejected block captured again", block_id=e.block_id,
                            reason=e.reason, capture_id=capture_id, attempt=attempt + 1)  # fmt: skip
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _abandon(
        self, call: asyncio.Future, capture_id: str, key: OwnedKey | None, attempt: int
    ) -> None:
        """A capture whose client went away: dropped if its forward has not started.
        Otherwise it goes on to publish, and a key then names its block, so a retry with
        the key follows that block instead of capturing a second one."""
        await self._capture.cancel(capture_id, timeout=CANCEL_TIMEOUT_S)
        if key is None:
            call.add_done_callback(runtime.discard_outcome)
            return
        try:
            captured = await call
        except Exception:  # dropped, or it failed: nothing published, the key goes back
            await (key.give_back() if attempt == 0 else key.lapse())
            return
        await key.point_to(captured.block_id, captured.prompt_tokens)
        log.info("abandoned request's block kept for its key", block_id=captured.block_id)

    async def _retake(self, stored: str, first: Record, mine: Record) -> int:
        """The key of a request whose block was rejected, for this retry; ReadoutFailed
        again if another retry took it first."""
        current = await self._keys.get(stored)
        if current is not None and current[0] == first:
            taken = await self._keys.update(stored, mine, current[1])
            if taken is not None:
                log.info("idempotency key retaken after a rejected block", block_id=first.block_id)
                return taken
        raise ReadoutFailed(f"block {first.block_id} was rejected; another retry runs it")

    async def _answer(
        self,
        p: GenerateParams,
        request_id: str,
        captured: CaptureResult,
        deadline: float,
        budget: float,
    ) -> Generation:
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise DeadlineExceeded(f"request {request_id}: no time left after capture")
        try:
            commit = await self._commits.watch_commit(captured.block_id, remaining)
        except BlockRejected as e:
            if e.reason in REQUEST_REASONS:  # e.g. deeper than the workers read
                raise InvalidRequest(
                    f"The readout workers refused the request: {e.detail or e.reason}.",
                    None,
                    e.reason,
                ) from e
            raise
        except CommitTimeout as e:
            raise DeadlineExceeded(
                f"request {request_id}: no answer committed within {budget:g}s"
            ) from e
        except RegistryError as e:
            raise Unavailable(f"request {request_id}: registry unavailable: {e}") from e
        lanes = sorted(commit.lanes, key=lambda a: a.lane_index)
        if sum(len(lane.token_ids) for lane in lanes) >= OFF_LOOP_TOKENS:
            choices = await asyncio.to_thread(self._choices, lanes, p.stop, p.sampling)
        else:
            choices = self._choices(lanes, p.stop, p.sampling)
        prompt_tokens = sum(captured.prompt_tokens[i * p.n] for i in range(len(p.inputs)))
        return Generation(
            request_id=request_id,
            model=p.model,
            created=int(time.time()),
            choices=choices,
            prompt_tokens=prompt_tokens,
            completion_tokens=sum(len(c.token_ids) for c in choices),
        )

    def _choices(
        self,
        lanes: Sequence[commit_pb2.LaneAnswer],
        stop: StopSpec,
        params: block_pb2.SamplingParams,
    ) -> tuple[ChoiceResult, ...]:
        return tuple(self._choice(lane, stop, params) for lane in lanes)

    def _choice(
        self, lane: commit_pb2.LaneAnswer, stop: StopSpec, params: block_pb2.SamplingParams
    ) -> ChoiceResult:
        cut = apply_stops(lane.token_ids, self.decode, stop)
        stopped = cut.stop_reason is not None or lane.eos_pos != NO_EOS
        logprobs = None
        if params.HasField("logprobs"):
            n = len(cut.token_ids)  # the kept tokens: a stop cuts their log-probabilities too
            if len(lane.token_logprobs) < n:
                raise Unavailable(
                    f"lane {lane.lane_index} of the commit carries no log-probabilities "
                    "(written by a readout worker that predates them?)"
                )
            tops = list(zip(lane.top1_ids, lane.top1_logprobs, lane.top2_ids, lane.top2_logprobs,
                            strict=True))[:n]  # fmt: skip
            logprobs = tuple(
                TokenLogprob(t, lp, ((a, la), (b, lb))[: params.logprobs])
                for t, lp, (a, la, b, lb) in zip(
                    cut.token_ids, lane.token_logprobs[:n], tops, strict=True
                )
            )
        return ChoiceResult(
            index=lane.lane_index,
            token_ids=cut.token_ids,
            text=cut.text,
            finish_reason="stop" if stopped else "length",
            eos_pos=lane.eos_pos,
            stop_reason=cut.stop_reason,
            logprobs=logprobs,
        )

    def detokenize(self, ids: Sequence[int]) -> str:
        """A client's token ids as text; InvalidRequest for an id outside the vocabulary."""
        params.check_token_ids(ids, self.vocab_size, "tokens")
        return self.decode(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens spelled out): what logprobs name."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        params.check_prompt_text(text, self.limits, "prompt")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def pieces(self, generation: Generation) -> Iterator[Piece]:
        """Stream chunks whose texts concatenate to each choice's text exactly."""
        for choice in generation.choices:
            ids = choice.token_ids
            step = max(self._config.stream_chunk_tokens, -(-len(ids) // MAX_STREAM_CHUNKS))
            sent_text, sent_ids = "", 0
            for end in range(step, len(ids), step):
                # Decode the prefix, not the slice: tokenizers that merge bytes or strip
                # leading spaces only decode a prefix faithfully.
                text = self.decode(ids[:end])
                if text.endswith("\ufffd") or not text.startswith(sent_text):
                    continue  # an incomplete character: wait for the rest
                yield Piece(choice.index, text[len(sent_text) :], ids[sent_ids:end], None, sent_ids)
                sent_text, sent_ids = text, end
            yield Piece(
                choice.index,
                choice.text[len(sent_text) :],
                ids[sent_ids:],
                choice.finish_reason,
                sent_ids,
            )
