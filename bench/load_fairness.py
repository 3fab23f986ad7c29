"""The load bench's fairness level (issue 38 item 3): one maximal request may not stall
small ones, so a short request's p99 beside it stays within 2x its p99 alone.

After the levels, on the same stack (`bench.load_gpu --big-clients B`):
1. alone: one client sends --fairness-requests small requests back to back (the first
   depth's prompts and answer length, the scale's prompt length), nothing else in flight;
2. beside: B clients send maximal requests back to back (--big-n distinct prompts of
   --big-prompt-len tokens a request, a lane each, max_tokens = --big-max-tokens; `n` of
   one prompt would be one lane to the capture; by default the limits the
   stack runs with: STATEBLOCK_PROMPT_LEN_MAX, _MAX_LANES and _ANSWER_DEPTH_MAX), and once
   each has sent its first, the small client sends the same small requests again. The big
   clients stop when it is done; their requests in flight finish and are counted.
Reported: the small requests' p50/p90/p99 alone and beside, p99 beside / p99 alone (the
target: <= 2), the slowest small requests beside and where they fell against the big
requests' sends and replies, how many small requests were sent while a big one was in flight, every small
answer compared with its prompt's reference answer, the big requests' count, latency and
errors, and the services' stages over the beside phase.
"""

from __future__ import annotations

import random
import threading
import time

from bench import load_probes
from bench.load_gpu import Level, summarize
from bench.models import SCALES, bench_prompt
from gateway.config import GatewayConfig
from stateblock.protocol.sampling import Limits

TARGET_P99_RATIO = 2.0


def stack_limits(env: list[tuple[str, str]]) -> Limits:
    """The request limits the bench's services run with: the --env settings over the
    defaults (bench.procs gives a service no other STATEBLOCK_* variable), read by the
    gateway's own config."""
    return GatewayConfig.from_env(dict(env)).limits


def big_shape(args) -> dict:
    """The maximal request: the arguments given, else the stack's limits."""
    limits = stack_limits(args.env)
    return {
        "prompt_len": args.big_prompt_len or limits.prompt_len_max,
        "n": args.big_n or limits.max_lanes,
        "max_tokens": args.big_max_tokens or limits.answer_depth_max,
        "limits": {
            "prompt_len_max": limits.prompt_len_max,
            "max_lanes": limits.max_lanes,
            "answer_depth_max": limits.answer_depth_max,
        },
    }


def overlapping(small: Level, big: Level) -> int:
    """Small requests sent while a big one was in flight (sent, not yet replied)."""
    spans = [(r[1], r[2]) for r in big.results]
    return sum(1 for r in small.results if any(s <= r[1] < e for s, e in spans))


def slowest(small: Level, big: Level, k: int = 3) -> list[dict]:
    """The k slowest small requests beside, each with where it fell against the big
    requests: ms from the nearest big request's send and reply to its own send (negative:
    before it). A stall that always follows a big reply points at that reply's path (its
    block's publish, readout, commit and decode), one near a send at its forward."""

    def nearest(t: float, marks: list[float]) -> float | None:
        return round(1000 * min((t - m for m in marks), key=abs), 1) if marks else None

    sends, replies = [r[1] for r in big.results], [r[2] for r in big.results]
    worst = sorted(small.results, key=lambda r: r[2] - r[1], reverse=True)[:k]
    return [
        {
            "ms": round(1000 * (r[2] - r[1]), 1),
            "from_big_send_ms": nearest(r[1], sends),
            "from_big_reply_ms": nearest(r[1], replies),
        }
        for r in worst
    ]


def ratio(num: dict, den: dict, key: str) -> float | None:
    a, b = num.get("latency_ms", {}).get(key), den.get("latency_ms", {}).get(key)
    return round(a / b, 2) if a and b else None


def beside_big(stack, url: str, prompts: list[str], depth: int, big: Level, args) -> tuple:
    """The small requests while B big clients send back to back: (small level, its start
    and stop, the big clients' start and stop, what `stage_window` saw over the phase)."""
    clients, requests = args.big_clients, args.fairness_requests
    window: list[tuple[float, float]] = []
    runner = threading.Thread(
        target=lambda: window.append(big.run(clients, float("inf"))), name="big", daemon=True
    )
    with load_probes.stage_window(stack) as seen:
        w0 = time.perf_counter()
        runner.start()
        while big.sent < clients and runner.is_alive():  # each big client has one in flight
            time.sleep(0.005)
        small = Level(url, prompts, depth, requests)
        s0, s1 = small.run(1, float("inf"))
        s1 = time.perf_counter()
        big.stop.set()
        runner.join()  # the big requests in flight finish (each within the client's timeout)
    return small, (s0, s1), window[0] if window else (w0, w0), seen


def measure(stack, url: str, prompts: list[str], refs: dict, depth: int, args) -> dict:
    """The fairness level on a running stack; `prompts` and `refs` are the first depth's
    (its reference answers, each prompt alone)."""
    shape = big_shape(args)
    rng = random.Random(args.seed + 1)
    vocab = SCALES[args.scale].vocab_size
    # a big request is n distinct prompts (n=1 each), not n of one: the capture runs one
    # prompt's identical lanes forward once, so only distinct ones make it maximal
    big_prompts = [
        [bench_prompt(rng, shape["prompt_len"], vocab) for _ in range(shape["n"])]
        for _ in range(args.big_clients)
    ]
    alone = Level(url, prompts, depth, args.fairness_requests)
    time.sleep(0.2)  # the last reference request's stages observed before the phase begins
    with load_probes.stage_window(stack) as seen_alone:
        a0, a1 = alone.run(1, float("inf"))
    alone_row = summarize(alone, 1, a0, a1, refs)
    big = Level(url, big_prompts, shape["max_tokens"], 0)
    small, (s0, s1), (g0, g1), seen = beside_big(stack, url, prompts, depth, big, args)
    beside_row = dict(
        summarize(small, 1, s0, s1, refs),
        beside_big=overlapping(small, big),
        slowest=slowest(small, big),
    )
    big_row = summarize(big, args.big_clients, g0, g1, {})
    p99 = ratio(beside_row, alone_row, "p99")
    met = p99 is not None and p99 <= TARGET_P99_RATIO
    return {
        "big_clients": args.big_clients,
        "small": {
            "prompt_len": args.prompt_len,
            "depth": depth,
            "requests": args.fairness_requests,
        },
        "big": {k: shape[k] for k in ("prompt_len", "n", "max_tokens")},
        "limits": shape["limits"],
        "alone": alone_row,
        "beside": beside_row,
        "big_requests": big_row,
        "p50_ratio": ratio(beside_row, alone_row, "p50"),
        "p99_ratio": p99,
        "target_p99_ratio": TARGET_P99_RATIO,
        "meets_target": met and beside_row["n_errors"] == 0 and big_row["n_errors"] == 0,
        "stages_alone": seen_alone["stages"],
        "stages_beside": seen["stages"],  # the big requests' stages counted in
        "loop_lag_alone": seen_alone["loop_lag"],
        "loop_lag_beside": seen["loop_lag"],
    }
