"""The `torch` readout engine: the GPU fast path (docs/ARCHITECTURE.md, "Engines").

On CUDA: the decoder in fp32, its mixer attention as one fp32 flash kernel
(`stateblock.model.kernels.attention`: no D x D score tensor, TF32 tensor-core dots), the
vocabulary top-2 over the fused head lm_head @ out.weight (V x d_r, fp32, TF32 dots) in the
Triton top-2 kernel (`stateblock.model.kernels.top2`: logits never leave the chip; `head="lm_head"`
keeps the bf16 lm_head GEMM), and one CUDA graph per shape bucket. On the CPU the same code
runs eagerly in fp32 with the chunked PyTorch top-2 and, by default, no buckets (exact
shapes, as the reference), so CI imports and tests it against the reference engine.
device="cuda" without a GPU raises EngineUnavailable. The shape buckets and the options
live in `torch_options`; the step every graph records, and the sampling, in `torch_step`.

Graphs. Recorded in warm_up(): with `warm_up_to` (the readout service passes its request
limits) every bucketed shape and precision path a request within them can take, so no
request records one; without it the common shapes (each depth bucket's execution lanes,
prompt bucket 512), and any other on the first cohort of its shape. Every graph reads one set of
static input buffers (views of one allocation sized for the largest bucket) and all share
one memory pool, which is safe because replays never overlap (one lock) and each
replay's outputs are read before the next replay starts. `beside()` is a second such set
(graphs, buffers, pool, lock) over the same weights, on a stream of its own: the readout
service reads long blocks' parts on it, beside the cohorts.

Greedy fast path (`greedy_dtype`: bf16 by default on a GPU, audited with the shipped
decoders, docs/PARITY.md; "float32" turns it off; off on the CPU). A cohort whose lanes all
take the argmax and ask for no log-probabilities runs a copy of the decoder, the fused head
and the guess table in bf16; any other cohort keeps the exact path, so log-probabilities
and seeded samples stay the reference's. The audit is what licenses it: a decoder whose
bf16 copy flips a token outside the near-ties fails the gate as served. fp16 is refused:
the shipped decoder's residual stream reaches about 350, whose square overflows fp16 in
the norms (319 of 4,947 tokens flipped at high margins on the CPU).

Sampling. Greedy lanes take the fused top-2. Lanes with temperature > 0 take, after the
replay, the chunked top-8 + Gumbel selection of the reference on the graph's hidden
states (correctness first; the noise is drawn per lane from its seed exactly as there).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from stateblock.engines.base import (
    LaneRequest,
    LaneResult,
    lane_result,
)
from stateblock.engines.torch_options import (
    DEPTH_BUCKETS,
    LANE_BUCKETS,
    PROMPT_BUCKETS,
    WARM_PROMPT,
    EngineUnavailable,
    Shape,
    TorchEngineOptions,
    bucket,
    execution_lanes,
    reachable_shapes,
    require_device,
)
from stateblock.engines.torch_step import (
    MATMUL_PRECISIONS,
    fused_head,
    greedy_path,
    lanes_on,
    matmul_precision,
    readout_step,
    sample_lanes,
    stage_lanes,
)
from stateblock.model.checkpoint import build_decoder
from stateblock.model.decoder import ReadoutDecoder
from stateblock.model.kernels.attention import DOT_PRECISIONS, dot_precision
from stateblock.model.kernels.attention import available as attention_available
from stateblock.model.kernels.top2 import Top2Config, available, default_tiles, top2
from stateblock.model.loading import ServingModel
from stateblock.protocol.envelope import ModelIdentity
from stateblock.protocol.sampling import K_MAX  # lanes per enqueue

# the step's pieces, for the benchmarks and tests that reach them through this module
__all__ = [
    "EngineUnavailable",
    "Shape",
    "TorchEngine",
    "TorchEngineOptions",
    "bucket",
    "dot_precision",
    "fused_head",
    "matmul_precision",
    "readout_step",
]


GREEDY = "greedy"  # the graphs' precision key of the greedy fast path


class TorchEngine:
    """SDPA + fused top-2 + CUDA graphs per shape bucket on CUDA; eager fp32 on the CPU."""

    name = "torch"

    def __init__(
        self,
        decoder: ReadoutDecoder,
        lm_head: Tensor,
        identity: ModelIdentity,
        *,
        eos_token_id: int,
        options: TorchEngineOptions | None = None,
    ) -> None:
        opts = options if options is not None else TorchEngineOptions()
        dev = require_device(opts.device)
        self._device = dev
        self._set_precisions(opts, dev)
        self._set_heads(decoder, lm_head, opts, dev)
        self.identity = identity
        self._eos = eos_token_id
        self._n_chunks = decoder.cfg.n_chunks
        self._set_shapes(opts, dev.type == "cuda")
        self._set_top2(opts.top2_config)
        # one graph per (shape, dot precision)
        self._graphs: dict[tuple[Shape, str], tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]]
        self._graphs = {}
        self._static: dict[str, Tensor] = {}
        self._pool = None
        self._lock = threading.Lock()  # workers call readout from a thread pool
        self._stream: torch.cuda.Stream | None = None  # beside()'s: its executions' stream

    def beside(self) -> TorchEngine:
        """This engine's decoder and heads with graphs, buffers and a lock of their own and,
        on CUDA, a stream of the lowest priority: a long block's parts read on it while the
        cohorts read on this engine (readout_svc.cohorts), neither waiting for the other's
        execution to end. Its graphs record the same kernels at the same shapes, so it reads
        every lane as this engine does."""
        other = copy.copy(self)
        other._graphs, other._static, other._pool = {}, {}, None
        other._lock = threading.Lock()
        if self._device.type == "cuda":
            other._stream = torch.cuda.Stream(self._device, priority=0)
        return other

    def _on_stream(self) -> AbstractContextManager:
        """Around an execution: this engine's stream (beside()'s), after the work the
        caller's stream has queued (the rows it wrote); the execution's copies to the host
        synchronise it before readout returns."""
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        return torch.cuda.stream(self._stream)

    def _set_precisions(self, opts: TorchEngineOptions, dev: torch.device) -> None:
        """The decoder's dtype, matmul and kernel-dot precisions, and its attention."""
        on_gpu = dev.type == "cuda"
        # Precision (docs/PARITY.md; shipped model, 32 held-out prompts, flips against the
        # fp32 reference): the decoder runs in fp32. Its matmuls in bf16 flip tokens at
        # margins up to ~0.8; even fp16 (`autocast`, 10 mantissa bits, fp32 residual and
        # norms) crosses the 0.05 near-tie bound at depth 2048 (0.071), so reduced precision
        # stays an opt-in that fails the parity gate.
        # TF32 passes the audit on the H200 (docs/PARITY.md). The engine uses it where it
        # says so per call: the Triton kernels' dots (`kernel_precision`, default "tf32" on
        # Ampere and later: the mixer's attention and the fused head). The decoder's linears
        # are cuBLAS calls that only torch's process-wide switch moves to TF32: that is the
        # opt-in `matmul_precision="high"`, for a readout process of its own, since while it
        # is on a capture in the same process would run its fp32 matmuls (the rotary
        # tables) in TF32 too.
        self._act = opts.decoder_dtype
        self._autocast = opts.autocast if on_gpu else None
        if opts.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}")
        self._precision = opts.matmul_precision if on_gpu else "highest"  # CPU: the reference's
        tf32_ok = on_gpu and torch.cuda.get_device_capability(dev) >= (8, 0)
        self._kernel_precision = opts.kernel_precision or ("tf32" if tf32_ok else "ieee")
        if self._kernel_precision not in DOT_PRECISIONS:
            raise ValueError(f"kernel_precision must be one of {DOT_PRECISIONS}")
        # A cohort with a lane that asks for log-probabilities runs its kernels' dots at
        # `logprob_precision`: TF32 states keep the tokens (the audit's near-ties) but put the
        # log-probabilities 1e-2 nats off on the H200, ten times the 1e-3 gate; exact fp32 dots
        # cost readout time only where a client asked for numbers. Its own CUDA graphs.
        if opts.logprob_precision not in DOT_PRECISIONS:
            raise ValueError(f"logprob_precision must be one of {DOT_PRECISIONS}")
        self._logprob_precision = opts.logprob_precision
        # The mixer's fp32 attention: the Triton flash kernel where it can run (SDPA's fp32
        # path has no tensor cores and is most of the decoder's time), else SDPA.
        # (rope too: rotated q and k are plain (K, H, n, hd) tensors; tests/gpu checks it)
        fused_ok = on_gpu and attention_available(dev) and opts.decoder_dtype == torch.float32
        self.attention = opts.attention or (
            "fused" if fused_ok and opts.autocast is None else "sdpa"
        )
        if self.attention not in ("sdpa", "fused"):
            raise ValueError(f"attention must be 'sdpa' or 'fused', not {self.attention!r}")
        if self.attention == "fused" and not (fused_ok and self._autocast is None):
            raise EngineUnavailable(
                "the fused attention kernel needs Triton, a CUDA device and an fp32 decoder "
                "without autocast"
            )

    def _set_heads(
        self, decoder: ReadoutDecoder, lm_head: Tensor, opts: TorchEngineOptions, dev
    ) -> None:
        """The decoder and lm_head on `dev`, the head the top-2 streams, the guess table and
        the greedy fast path."""
        on_gpu = dev.type == "cuda"
        self._decoder = decoder.to(device=dev, dtype=opts.decoder_dtype).eval()
        self._decoder.requires_grad_(False)
        # no copy when lm_head already lives on `dev` in `dtype`: bound by reference
        self._lm_head = lm_head.to(dev, torch.bfloat16 if on_gpu else torch.float32)
        # The head the top-2 streams. "fused" (the GPU default): lm_head @ out.weight, a
        # (V, d_r) = (131072, 256) matrix (128 MB in fp32) computed once here, so the
        # vocabulary GEMM runs over d_r = 256 instead of d_base = 2688 (10.5x fewer FLOPs).
        # "lm_head": the decoder's hidden states against the resident lm_head in bf16.
        self.head = opts.head or ("fused" if on_gpu else "lm_head")
        if self.head == "fused":
            self._head = fused_head(self._lm_head, self._decoder.out.weight, opts.head_dtype)
        elif self.head == "lm_head":
            self._head = self._lm_head
        else:
            raise ValueError(f"head must be 'fused' or 'lm_head', not {self.head!r}")
        # a refining decoder's first guess re-enters as guess_in(lm_head[id]): one (V, d_r)
        # table built here like the fused head, so a guess is a row gather
        self._guess_table = (
            fused_head(self._lm_head, self._decoder.guess_in.weight.t(), opts.decoder_dtype)
            if decoder.cfg.refine
            else None
        )
        # the greedy fast path: (decoder, head, guess table) in greedy_dtype, or None. The
        # GPU default since its audit (bf16: exact at every depth, docs/PARITY.md; 1.11x the
        # lm_head floor at D=8192 against 1.97x exact); the CPU keeps the reference's numerics
        greedy = opts.greedy_dtype
        self._greedy = greedy_path(
            self._decoder,
            self._lm_head,
            fused=self.head == "fused",
            dtype=greedy if greedy is not None else ("bfloat16" if on_gpu else None),
        )

    def _set_shapes(self, opts: TorchEngineOptions, on_gpu: bool) -> None:
        """The lane, prompt and depth buckets, CUDA graphs on or off, the shapes to warm."""

        # buckets default to exact shapes on the CPU: padding there only costs time
        def pick(given: Sequence[int] | None, default: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(sorted(given)) if given is not None else (default if on_gpu else ())

        self._lane_b = pick(opts.lane_buckets, LANE_BUCKETS)
        self._prompt_b = pick(opts.prompt_buckets, PROMPT_BUCKETS)
        self._depth_b = pick(opts.depth_buckets, DEPTH_BUCKETS)
        self._k_max = max(self._lane_b, default=K_MAX)
        self._use_graphs = on_gpu if opts.cuda_graphs is None else opts.cuda_graphs
        if self._use_graphs and not on_gpu:
            raise EngineUnavailable("CUDA graphs need a CUDA device")
        if self._use_graphs and not (self._lane_b and self._prompt_b and self._depth_b):
            raise ValueError("CUDA graphs need lane, prompt and depth buckets")
        if opts.warm_shapes is not None:
            self._warm = tuple(opts.warm_shapes)
        elif opts.warm_up_to is not None:
            self._warm = reachable_shapes(
                *opts.warm_up_to, self._lane_b, self._prompt_b, self._depth_b
            )
        else:
            self._warm = tuple(
                Shape(execution_lanes(d, self._lane_b), bucket(WARM_PROMPT, self._prompt_b) or 1, d)
                for d in self._depth_b
            )
        self._warm_every_path = opts.warm_up_to is not None

    def _set_top2(self, top2_config: Top2Config | None) -> None:
        """One top-2 function per dot precision the cohorts run at."""
        dev = self._device
        self.top2_backend = "triton" if available(dev) else "torch-chunked"
        # an fp32 head's dots (the fused head's) run at kernel_precision
        tiles = top2_config or default_tiles(dev, self._head.dtype)
        self._top2 = {
            p: partial(top2, n_chunks=self._n_chunks, cfg=replace(tiles, precision=p))
            for p in {self._kernel_precision, self._logprob_precision}
        }
        if self._greedy is not None:  # low-precision inputs: the tiles of that width
            self._top2[GREEDY] = partial(
                top2,
                n_chunks=self._n_chunks,
                cfg=top2_config or default_tiles(dev, self._greedy[1].dtype),
            )

    @classmethod
    def load(cls, model: ServingModel, device: str = "cpu", **options) -> TorchEngine:
        """The shipped decoder against `model`; options are TorchEngineOptions' fields."""
        dev = require_device(device)  # before loading anything: fail fast and clearly
        opts = TorchEngineOptions(device=dev, **options)
        decoder = build_decoder(
            model.decoder_dir, model.manifest, device=dev, dtype=opts.decoder_dtype
        )
        eos = model.manifest["decoder_config"]["eos_token_id"]
        return cls(decoder, model.lm_head, model.identity, eos_token_id=eos, options=opts)

    @property
    def recorded_shapes(self) -> list[Shape]:
        """The shapes with a recorded graph at the default dot precision."""
        return [s for s, p in self._graphs if p == self._kernel_precision]

    @property
    def recorded(self) -> list[tuple[Shape, str]]:
        """Every recorded graph: its shape and its kernels' dot precision."""
        return list(self._graphs)

    # -- shapes and staging -------------------------------------------------------------
    def _shape(self, lanes: Sequence[LaneRequest]) -> tuple[Shape, bool]:
        """The shape every execution of these lanes runs at, and whether it is bucketed (a
        graph's): the depth bucket's execution lanes (torch_options.execution_lanes), the
        prompt and depth buckets of the longest; beyond the buckets, exact sizes, eagerly."""
        p = max(lane.rows.shape[0] for lane in lanes)
        d = max(lane.depth for lane in lanes)
        pb, db = bucket(p, self._prompt_b), bucket(d, self._depth_b)
        if self._lane_b and pb is not None and db is not None:
            return Shape(execution_lanes(db, self._lane_b), pb, db), True
        return Shape(min(len(lanes), self._k_max), pb or p, db or d), False

    def cohort_key(self, lanes: Sequence[LaneRequest]) -> tuple:
        """Blocks with equal keys read the same together as alone (readout_svc.cohorts): the
        same precision path, depth bucket and prompt bucket (or, beyond them, the exact
        prompt length, which runs eagerly at its size) give every execution one shape, its
        lanes fixed by the depth bucket."""
        d = max(lane.depth for lane in lanes)
        p = max(lane.rows.shape[0] for lane in lanes)
        pb = bucket(p, self._prompt_b)
        return self._path(lanes), bucket(d, self._depth_b) or d, pb is not None or p

    def _path(self, lanes: Sequence[LaneRequest]) -> str:
        """The precision key a cohort runs on: exact dots when a lane asks for
        log-probabilities, the greedy fast path when every lane is plain greedy."""
        if any(lane.sampling.HasField("logprobs") for lane in lanes):
            return self._logprob_precision
        if self._greedy is not None and not any(x.selects for x in lanes):
            return GREEDY
        return self._kernel_precision

    def _buffers(self, shape: Shape) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Static (rows, lens, positions, depths) views for `shape`, all graphs sharing them."""
        if not self._static:
            k, p, d = max(self._lane_b), max(self._prompt_b), max(self._depth_b)
            dev, d_base = self._device, self._lm_head.shape[1]
            self._static = {
                "rows": torch.zeros(k * p * d_base, dtype=self._act, device=dev),
                "lens": torch.ones(k, dtype=torch.int64, device=dev),
                "depths": torch.zeros(k, dtype=torch.int64, device=dev),
                "positions": torch.arange(d, device=dev).expand(k, d),
            }
        s, k = self._static, shape.lanes
        n = k * shape.prompt * self._lm_head.shape[1]
        rows = s["rows"][:n].view(k, shape.prompt, -1)  # contiguous: a prefix of one storage
        return rows, s["lens"][:k], s["positions"][:k, : shape.depth], s["depths"][:k]

    def _step(self, precision, rows, lens, positions, depths) -> tuple[Tensor, ...]:
        fast = precision == GREEDY
        decoder, head, table = (
            self._greedy if fast else (self._decoder, self._head, self._guess_table)
        )
        return readout_step(
            decoder,
            head,
            rows.to(head.dtype) if fast else rows,
            lens,
            positions,
            depths,
            eos_token_id=self._eos,
            top2_fn=self._top2[precision],
            autocast=None if fast else self._autocast,
            precision=self._precision,
            # the fused attention kernel is fp32-only: the fast path's attention is SDPA's
            kernel_precision=self._kernel_precision if fast else precision,
            attention="sdpa" if fast else self.attention,
            fused=self.head == "fused",
            guess_table=table,
        )

    # -- CUDA graphs --------------------------------------------------------------------
    def _record(
        self, shape: Shape, precision: str
    ) -> tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...]]:
        rows, lens, positions, depths = self._buffers(shape)
        rows.zero_()
        lens.fill_(1)
        depths.fill_(shape.depth)
        step = partial(self._step, precision, rows, lens, positions, depths)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # one eager run on a side stream first: Triton compiles, cuBLAS and SDPA pick their
        # kernels and workspaces outside the recording
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads (the capture service's forward in the
        # embedded stack) must not invalidate this recording
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = step()
        self._graphs[shape, precision] = (graph, out)
        return graph, out

    def _replay(
        self, shape: Shape, precision: str, lanes: Sequence[LaneRequest]
    ) -> tuple[Tensor, ...]:
        graph, out = self._graphs.get((shape, precision)) or self._record(shape, precision)
        rows, lens, _, depths = self._buffers(shape)
        stage_lanes(lanes, rows, lens, depths)
        graph.replay()
        return out

    def _eager(
        self, shape: Shape, precision: str, lanes: Sequence[LaneRequest]
    ) -> tuple[Tensor, ...]:
        dev, k = self._device, shape.lanes
        rows = torch.zeros(k, shape.prompt, self._lm_head.shape[1], dtype=self._act, device=dev)
        lens = torch.ones(k, dtype=torch.int64, device=dev)
        depths = torch.zeros(k, dtype=torch.int64, device=dev)
        stage_lanes(lanes, rows, lens, depths)
        positions = torch.arange(shape.depth, device=dev).expand(k, shape.depth)
        return self._step(precision, rows, lens, positions, depths)

    # -- the protocol -------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the common shapes at start-up (CPU: one throwaway readout)."""
        with self._lock, self._on_stream():
            if self._use_graphs:
                warm = [self._kernel_precision] + ([GREEDY] if self._greedy else [])
                if self._warm_every_path and self._logprob_precision not in warm:
                    warm.append(self._logprob_precision)  # a cohort asking log-probabilities
                for shape in self._warm:
                    for p in warm:
                        if (shape, p) not in self._graphs:
                            self._record(shape, p)
                torch.cuda.synchronize(self._device)
                return
        rows = torch.zeros(4, self._lm_head.shape[1], dtype=self._act)
        self.readout([LaneRequest(rows=rows, depth=16)])

    @torch.inference_mode()
    def readout(self, lanes: Sequence[LaneRequest]) -> list[LaneResult]:
        if not lanes:
            return []
        if any(lane.depth < 1 for lane in lanes):
            raise ValueError("every lane must read at least one position")
        shape, bucketed = self._shape(lanes)
        results: list[LaneResult] = []
        with self._on_stream():
            for lo in range(0, len(lanes), shape.lanes):  # one enqueue each, all of one shape
                results += self._cohort(lanes[lo : lo + shape.lanes], shape, bucketed)
        return results

    def _cohort(
        self, lanes: Sequence[LaneRequest], shape: Shape, bucketed: bool
    ) -> list[LaneResult]:
        k = len(lanes)
        wants_lp = any(lane.sampling.HasField("logprobs") for lane in lanes)
        precision = self._path(lanes)
        # rows in host memory reach the device before the lock: their copy waits on the
        # device's queue, and meanwhile another caller's execution holds the lock and runs
        lanes = lanes_on(lanes, self._device)
        with self._lock:  # static buffers and graph outputs are shared by all callers
            if self._use_graphs and bucketed:
                h, top_v, top_i, eos, lse = self._replay(shape, precision, lanes)
            else:
                h, top_v, top_i, eos, lse = self._eager(shape, precision, lanes)
            tokens, chosen = top_i[:k, :, 0], top_v[:k, :, 0]
            eos = eos[:k]
            sampled = [i for i, lane in enumerate(lanes) if lane.selects]
            if sampled:
                tokens, eos, chosen = sample_lanes(
                    lanes, sampled, h, tokens, eos, chosen, shape.depth,
                    head=self._head, n_chunks=self._n_chunks, eos_token_id=self._eos,
                )  # fmt: skip
            # copies out of the graph's outputs, then each lane cut as every engine cuts it
            margins = (top_v[:k, :, 0] - top_v[:k, :, 1]).cpu().tolist()
            tokens, eos_pos = tokens.cpu().tolist(), eos.cpu().tolist()
            lp = None
            if wants_lp:
                z = lse[:k]
                lp = [
                    x.cpu().tolist()
                    for x in (
                        chosen - z,
                        top_i[:k, :, 0],
                        top_v[:k, :, 0] - z,
                        top_i[:k, :, 1],
                        top_v[:k, :, 1] - z,
                    )
                ]
        return [
            lane_result(
                lane,
                tokens[i],
                margins[i],
                int(eos_pos[i]),
                tuple(x[i] for x in lp) if lp else None,
            )  # fmt: skip
            for i, lane in enumerate(lanes)
        ]
