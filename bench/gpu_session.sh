#!/usr/bin/env bash
# The issue-5 GPU runs, one stage per device call (each under 10 minutes), from the repo root
# on the H200 with `.whl` carried (bash bench/prepare_wheels.sh first, here):
#   bash bench/gpu_session.sh checks   # kernel + engine checks and timings, torch audit, GPU tests
#   bash bench/gpu_session.sh smoke    # timings (no checks), the audit, the GPU tests
#   bash bench/gpu_session.sh measure  # a new shipped decoder: the held-out eval on the GPU
#                                      # (30 a family; 100 a family on seeds 1234, 7, 99 into
#                                      # eval-cuda-100.tgz), then smoke (QUALITY.md, PARITY.md)
#   bash bench/gpu_session.sh e2e-both [ARGS]  # the e2e in one process (+ AR), then per service
#   bash bench/gpu_session.sh e2e-procs [ARGS] # the e2e per service (+ compiled AR), then in
#                                              # one process (no AR)
#   bash bench/gpu_session.sh final [ARGS]  # smoke (no checks, TF32 audit), e2e (no NemotronH)
#   bash bench/gpu_session.sh e2e [ARGS]  # the 2.9 B end-to-end run vs AR decoding; ARGS go
#                                         # to bench.e2e_gpu (e.g. --capture-compile ...)
#   bash bench/gpu_session.sh load [ARGS] # bench.load_gpu: 1-128 clients, 256 and 1,014
#                                         # tokens, batched AR (about 6-8 minutes)
#   bash bench/gpu_session.sh planes [ARGS]  # the GPU tests of the data planes (company,
#                                         # ipc, two forward threads), then bench.load_gpu on
#                                         # the ipc and host planes at 8, 64, 128 clients
#   bash bench/gpu_session.sh compiled [ARGS]  # the capture compiled `default` (deterministic
#                                         # kernels, 2 forwards at once): a cold start and
#                                         # 1-128 clients with compiled AR at batch 64, two
#                                         # captures at 128 (do replicas agree?); RATE=1 adds
#                                         # the forward's rate (about 9 minutes, 11 with it)
#   bash bench/gpu_session.sh lanes-mps [ARGS]  # the stack of `compiled` (cohorts unpadded,
#                                         # attention unmasked) at 1, 64, 128 clients, again
#                                         # under CUDA MPS (the processes' kernels share the
#                                         # GPU instead of taking turns) at 64 and 128; lane
#                                         # 0's rows at 1-32 lanes (odd counts too), compiled
#                                         # `default` (about 9 minutes; PARTS=plain: 4)
#   bash bench/gpu_session.sh lone [ARGS]  # a request alone as one lane (MIN_LANES=1): lane
#                                         # 0's rows at 1-32 lanes compiled with the lane
#                                         # count unbacked, then 1 and 64 clients (8 minutes)
#   bash bench/gpu_session.sh forward [ARGS]  # bench.forward_rate at 20 and 30 lanes,
#                                         # profiled, against plain matmuls: compiled as the
#                                         # capture serves it, then autotuned
#                                         # (max-autotune-no-cudagraphs; about 8 minutes)
#   bash bench/gpu_session.sh fairness [ARGS]  # one client sending maximal requests beside
#                                         # one sending small ones, compiled `default`, host
#                                         # plane: parts on 66 SMs, then of 8,192 tokens
#                                         # (ARMS="sms66 tokens8192"; `cohort`: parts at the
#                                         # cohort bound; up to 230 s an arm: two a call)
#   WHL=.whl-eval bash bench/gpu_session.sh served-eval  # the capture's stream priorities
#       # (GPU test), the shipped pair's held-out eval (30 a family) on the rows the
#       # compiled capture service gives, fused rotary and table (EVALS="off default table":
#       # off a masked eager capture); carry models/ and .whl-eval (bench/prepare_wheels.sh:
#       # the wheels these import; 2 minutes)
#   bash bench/gpu_session.sh startup [ARGS]  # bench.compile_cache: the compiled capture's
#                                         # warm-up from nothing, then from its compile cache
#   bash bench/gpu_session.sh invariance [ARGS]  # bench.capture_invariance: one prompt's
#                                         # rows at 1-32 lanes, eager and compiled (minutes)
#   bash bench/gpu_session.sh prose [DATA [ARGS]]  # the prose base (issue 41): arms of
#       # stateblock.train.prose_stage on DATA (default .gpu_prose, written here by
#       # bench/prose_prepare.sh; its train ids made there from its corpus text, `train_ids`;
#       # no wheels needed), about 7 minutes;
#       # ARGS go to the trainer (e.g. --init DATA/base --epochs 6)
#   bash bench/gpu_session.sh prose-readout [DATA [ARGS]]  # the prose pair after the base
#       # (issue 41): stateblock.train.prose_readout --scale bench on DATA/base.part* (a prose
#       # stage's weights), DATA/tokenizer and DATA/readout/tasks (written here with --until
#       # tasks): tuned base, teacher, readout, evaluation, about 3 minutes; summary in $OUT;
#       # carry .whl-prose (bench/prose_prepare.sh: blake3, cryptography), and run it
#       # with models/ moved out of the working tree: the base's 53.5 MB and the tracked
#       # tree do not fit one call's 64 MiB together. DATA/base.part*.safetensors.xz and
#       # DATA/corpus/*.txt.gz are unpacked first (`bench.unpack`); with a corpus, the train
#       # prompts are made on the machine (--tune-prompts: more than a call could carry)
#   bash bench/gpu_session.sh prose-chain [DATA [ARGS]]  # issue 41 from nothing in one call:
#       # a 7-pass base on DATA's shards (prose_stage, skipped when DATA/base.part* is there),
#       # then prose-readout's chain on it with 250,000 tuning prompts made on the machine;
#       # DATA: prose_shards' folder with corpus/train.txt.gz and readout/tasks (--until
#       # tasks) beside (docs/QUALITY.md "To run"); ARGS go to prose_readout. DATA stays on
#       # the machine while it is held, for:
#   bash bench/gpu_session.sh prose-base [DATA [ARGS]]  # a larger base than prose-chain's, in
#       # a call of its own (about 9 minutes; ARGS to prose_stage, e.g. --dim 512 --n-layers
#       # 10 --mlp-dim 2048 --n-heads 8 --epochs 7): its weights stay on the machine as
#       # DATA/base.part* (too large to come back), so prose-chain on the same warm machine,
#       # called at once, skips its own base and builds the pair on this one
#   bash bench/gpu_session.sh prose-more [DATA [MINUTES [ARGS]]]  # on the same warm machine,
#       # carrying .whl-prose alone: the last decoder goes on distilling MINUTES (default 7;
#       # ARGS to prose_readout, e.g. --distill-lr 3e-4) and is evaluated;
#       # the pair comes back as prose-readout's does (pair.tar.xz.NN), for bench.prose_api
#   bash bench/gpu_session.sh prose-arms [DATA [ARGS]]  # on the same warm machine after
#       # prose-chain, carrying .whl-prose alone: a readout distilled MINUTES (default 3) per
#       # arm of ARMS (default "plain twin": --copy none, then prose_readout --copy twin;
#       # `tokens`: --row-tokens; `MODE+guess`: --copy MODE --copy-guess 4,
#       # `+follow` --copy-follow, `+span` --copy-span, `+match` --copy-match 16, `+ends`
#       # --copy-match-ends, `+point` --copy-point,
#       # joined: twin+guess+span) on
#       # the chain's tuned base and teacher, each evaluated; summaries in $OUT/ARM/
# The headline e2e flags: --capture-compile reduce-overhead --blocks-storage memory
# --greedy-dtype bfloat16. In one process with them the bench has died (a SIGSEGV: reusing the
# compiled model for the eager AR) and hung in the stack's stop (the capture service freeing
# its CUDA graph trees); the stack and the bench take neither step (docs/BENCHMARKS.md).
# e2e-procs times the stack per service first.
# Outputs go to $OUT as each step ends; the logs end up in $OUT/logs.tgz.
set -uo pipefail
STAGE=${1:?checks, smoke, measure, final, load, planes, compiled, lanes-mps, forward, fairness, served-eval, lone, startup, invariance, prose, prose-base, prose-readout, prose-chain, prose-arms, prose-more, e2e, e2e-both or e2e-procs}
case "$STAGE" in  # the prose stages carry no service wheels: the readout's needs blake3 alone
  prose) ;;
  prose-base|prose-readout|prose-chain|prose-arms|prose-more)
    if [ -d "${WHL:-.whl}" ]; then source bench/gpu_env.sh || exit 1; fi ;;
  *) source bench/gpu_env.sh || exit 1 ;;
esac
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
train_ids() {  # DATA's train ids from its corpus text, unless there (bench/prose_prepare.sh)
  [ -f "$1/train.npy" ] || python3 -m stateblock.train.prose_shards --corpus "$1/corpus" \
    --tokenizer "$1/tokenizer" --out "$1" --splits train > "$OUT/train_ids.log" 2>&1 \
    || { tail -5 "$OUT/train_ids.log"; return 1; }
}
pack_pair() {  # WORK's pair (tuned base, decoder, the teacher's answers when they fit) in
  # $OUT/pair.tar.xz.NN, parts a call returns (15 MiB a file; 8 files, 64 MiB in all)
  local w=$1
  [ -f "$w/decoder/manifest.json" ] && [ -f "$w/tuned/config.json" ] || return 0
  # the carried .xz copies stay behind; the teacher only when the whole comes back beside
  # the logs and summaries (64 MiB a call)
  tar -C "$w" --exclude='*.xz' -cf - tuned decoder teacher | xz -T0 -6 > "$OUT/pair.tar.xz"
  if [ "$(stat -c %s "$OUT/pair.tar.xz")" -gt 60000000 ]; then
    tar -C "$w" --exclude='*.xz' -cf - tuned decoder | xz -T0 -6 > "$OUT/pair.tar.xz"
  fi
  split -b 15M -d "$OUT/pair.tar.xz" "$OUT/pair.tar.xz." && rm "$OUT/pair.tar.xz"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
if [ "$STAGE" = final ]; then  # one call for the last minutes of a session: smoke, then e2e
  timeout 220 python3 -m bench.gpu_smoke --out "$OUT" --skip-checks --audit \
    > "$OUT/smoke.log" 2>&1
  echo "smoke rc=$?"
  timeout 330 python3 -m bench.e2e_gpu --out "$OUT" --scale full --engine torch --n 50 \
    --nemotron none --budget-s 300 "${@:2}" > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"
  grep -A60 '^summary' "$OUT/smoke.log"; tail -c 3500 "$OUT/e2e.log"
elif [ "$STAGE" = e2e-both ]; then  # the e2e in one process (with AR), then a process each
  mkdir -p "$OUT/inproc" "$OUT/procs"
  timeout 320 python3 -m bench.e2e_gpu --out "$OUT/inproc" --scale full --engine torch --n 50 \
    --nemotron none --budget-s 300 "${@:2}" > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"
  timeout 240 python3 -m bench.e2e_gpu --out "$OUT/procs" --scale full --engine torch --n 50 \
    --nemotron none --budget-s 220 --processes --ar-compiled off --ar-eager-repeats 0 \
    "${@:2}" > "$OUT/e2e-procs.log" 2>&1
  echo "e2e procs rc=$?"
  tail -c 2500 "$OUT/e2e.log"; tail -c 1800 "$OUT/e2e-procs.log"
elif [ "$STAGE" = e2e-procs ]; then  # the deployment's shape with AR, then one event loop
  mkdir -p "$OUT/procs" "$OUT/inproc"
  timeout 330 python3 -m bench.e2e_gpu --out "$OUT/procs" --scale full --engine torch --n 50 \
    --nemotron none --budget-s 310 --processes --ar-eager-repeats 0 "${@:2}" \
    > "$OUT/e2e-procs.log" 2>&1
  echo "e2e procs rc=$?"
  timeout 200 python3 -m bench.e2e_gpu --out "$OUT/inproc" --scale full --engine torch --n 50 \
    --nemotron none --budget-s 180 --ar-compiled off --ar-eager-repeats 0 "${@:2}" \
    > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"
  tail -c 2600 "$OUT/e2e-procs.log"; tail -c 1800 "$OUT/e2e.log"
elif [ "$STAGE" = load ]; then  # the throughput-latency curve; JSON, markdown, PNG in $OUT
  timeout 570 python3 -m bench.load_gpu --out "$OUT" --budget-s 540 "${@:2}" \
    > "$OUT/load.log" 2>&1
  echo "load rc=$?"
  tail -c 6000 "$OUT/load.log"
elif [ "$STAGE" = planes ]; then  # issue 38's data planes: GPU tests, then host vs ipc at load
  timeout 120 python3 -m pytest -q -rs tests/gpu -k "company or ipc or two_forward_threads" \
    > "$OUT/pytest-planes.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/pytest-planes.log"
  for plane in ipc host; do
    mkdir -p "$OUT/$plane"
    timeout 190 python3 -m bench.load_gpu --out "$OUT/$plane" --depths 256 --levels 8,64,128 \
      --ar-batches '' --ar-reserve-s 0 --budget-s 170 --env STATEBLOCK_DATA_PLANE=$plane \
      "${@:2}" > "$OUT/load-$plane.log" 2>&1
    echo "load $plane rc=$?"; tail -c 2500 "$OUT/load-$plane.log"
  done
elif [ "$STAGE" = compiled ]; then  # a cold start, load with AR at 64, two captures at 128
  flags=(--depths 256 --prompts 32 --ar-reserve-s 150 --capture-compile default
    --env STATEBLOCK_DATA_PLANE=host --env STATEBLOCK_PROMPT_LEN_MAX=512
    --env STATEBLOCK_CAPTURE_LANE_BUCKETS=2,8,32)
  # the first from an empty inductor cache (a fresh machine): its stack_start_s is a cold
  # start; its batched compiled AR at 64 gives the ratio at 64 clients
  for run in one:1:1,8,64,128:380:64 two:2:128:170:; do
    IFS=: read -r name captures levels limit ar <<<"$run"
    timeout "$limit" python3 -m bench.load_gpu --out "$OUT/$name" "${flags[@]}" \
      --levels "$levels" --captures "$captures" --ar-batches "$ar" \
      --budget-s $((limit - 15)) "${@:2}" > "$OUT/load-$name.log" 2>&1
    echo "load $name rc=$?"; grep -E '^\| [0-9]+ \||^Saturation|^setup|[Rr]atio' "$OUT/$name/load.md"
  done
  if [ -n "${RATE:-}" ]; then  # the forward alone (about 2 minutes more)
    timeout 130 python3 -m bench.forward_rate --out "$OUT/rate" --compile default \
      --lanes 8,16,30,32 --peak-tflops 755 --profile-lanes 30 > "$OUT/rate.log" 2>&1
    echo "forward rate rc=$?"; tail -24 "$OUT/rate/forward_rate.md"
  fi
  tar czf "$OUT/compiled.tgz" -C "$OUT" one two $( [ -d "$OUT/rate" ] && echo rate ) &&
    rm -r "$OUT/one" "$OUT/two" "$OUT/rate" 2>/dev/null
elif [ "$STAGE" = lanes-mps ]; then  # unpadded cohorts under load, then under MPS; invariance
  # MIN_LANES stays 2 here: one lane alone (MIN_LANES=1) is the `lone` stage's
  flags=(--depths 256 --prompts 32 --ar-batches '' --ar-reserve-s 0 --capture-compile default
    --env STATEBLOCK_DATA_PLANE=host --env STATEBLOCK_PROMPT_LEN_MAX=512
    --env STATEBLOCK_CAPTURE_LANE_BUCKETS=2,8,32)
  parts=${PARTS:-plain,mps,invariance}  # a shorter call: PARTS=plain
  # an MPS daemon left by a call cut short would take every later CUDA process (error 805)
  pgrep -f nvidia-cuda-mps-control > /dev/null && { echo quit | nvidia-cuda-mps-control; sleep 2; }
  for run in plain:0:1,64,128:${PLAIN_S:-240} mps:1:64,128:150 invariance; do
    IFS=: read -r name mps levels limit <<<"$run"
    [[ ",$parts," == *",$name,"* ]] || continue
    if [ "$name" = invariance ]; then  # the compiled lanes as the service runs them
      timeout 150 python3 -m bench.capture_invariance --out "$OUT/invariance.json" --modes \
        off,default --unmasked --lanes 1,2,3,5,8,13,19,27,32 > "$OUT/invariance.log" 2>&1
      echo "invariance rc=$?"; tail -c 1500 "$OUT/invariance.log"; continue
    fi
    if [ "$mps" = 1 ]; then  # the control daemon, default pipe dir: every CUDA process joins
      trap 'echo quit | nvidia-cuda-mps-control' EXIT  # also when the call's limit stops us
      nvidia-cuda-mps-control -d && timeout 60 python3 -c "import torch; torch.ones(1, device='cuda')" ||
        { echo "no MPS here"; echo quit | nvidia-cuda-mps-control; continue; }
    fi
    timeout "$limit" python3 -m bench.load_gpu --out "$OUT/$name" "${flags[@]}" \
      --levels "$levels" --budget-s $((limit - 15)) "${@:2}" > "$OUT/load-$name.log" 2>&1
    echo "load $name rc=$?"; grep -E '^\| [0-9]+ \||^Saturation|^setup' "$OUT/$name/load.md"
    tar czf "$OUT/$name.tgz" -C "$OUT" "$name" "load-$name.log" && rm -r "$OUT/$name" "$OUT/load-$name.log"
    [ "$mps" = 1 ] && { echo quit | nvidia-cuda-mps-control; trap - EXIT; sleep 2; }
  done
elif [ "$STAGE" = lone ]; then  # a request alone as one lane (STATEBLOCK_CAPTURE_MIN_LANES=1)
  # lane 0's rows at 1-32 lanes through the unbacked-lane graph, then the stack at 1 and 64
  # clients (torch 2.11 stopped the earlier size-oblivious graph: CantSplit, BENCHMARKS.md)
  timeout 170 python3 -m bench.capture_invariance --out "$OUT/invariance-lone.json" --modes \
    off,default --unmasked --size-oblivious --lanes 1,2,3,5,8,13,19,27,32 \
    > "$OUT/invariance-lone.log" 2>&1
  echo "invariance, size-oblivious: rc=$?"; tail -c 1500 "$OUT/invariance-lone.log"
  timeout 300 python3 -m bench.load_gpu --out "$OUT/lone" --depths 256 --prompts 32 \
    --ar-batches '' --ar-reserve-s 0 --capture-compile default --env STATEBLOCK_DATA_PLANE=host \
    --env STATEBLOCK_PROMPT_LEN_MAX=512 --env STATEBLOCK_CAPTURE_LANE_BUCKETS=2,8,32 \
    --env STATEBLOCK_CAPTURE_MIN_LANES=1 --levels 1,64 --budget-s 285 "${@:2}" \
    > "$OUT/load-lone.log" 2>&1
  echo "load, one lane alone: rc=$?"; grep -E '^\| [0-9]+ \||^Saturation|^setup' "$OUT/lone/load.md"
elif [ "$STAGE" = forward ]; then  # the compiled forward as served, then autotuned
  # served: `default`, unmasked, deterministic kernels; autotuned: inductor's Triton matmul
  # templates timed against cuBLAS, epilogues fused where they win
  # (PARTS=served: one); rope: as served with the rotary's cos and sin a table evaluated
  # once a forward; cudnn, efficient, flash: as served with SDPA pinned to that kernel
  # family, compiled afresh (PARTS="served rope flash"); triton: autotuned among inductor's
  # Triton matmul templates alone (pointwise epilogues fused into them)
  for run in ${PARTS:-served autotuned}; do
    flags=(--compile default)
    case "$run" in
      autotuned) flags=(--compile max-autotune-no-cudagraphs --autotune) ;;
      triton) flags=(--compile max-autotune-no-cudagraphs --autotune --gemm-backends TRITON) ;;
      rope) flags=(--compile default --rope-table) ;;
      cudnn|efficient|flash) flags=(--compile default --sdpa-backend "$run") ;;
    esac
    timeout 280 python3 -m bench.forward_rate --out "$OUT/$run" "${flags[@]}" --unmasked \
      --lanes 20,30 --profile-lanes 30 --gemm-lanes 30 "${@:2}" > "$OUT/forward-$run.log" 2>&1
    echo "forward $run rc=$?"; cat "$OUT/$run/forward_rate.md" 2>/dev/null
  done
elif [ "$STAGE" = fairness ]; then  # a maximal request beside small ones, compiled capture
  # an arm each: cohort (parts at the cohort bound), tokensN (STATEBLOCK_CAPTURE_PART_TOKENS),
  # smsN (STATEBLOCK_CAPTURE_PART_SMS: parts in a green context of N SMs), yieldS
  # (STATEBLOCK_CAPTURE_PART_YIELD_S: parts wait up to S seconds for busy cohorts), chunkN
  # (STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS: a long lane N positions a turn), planeX
  # (STATEBLOCK_DATA_PLANE=X instead of host: planeipc keeps the rows on the GPU)
  # (joined by +: sms66+tokens8192 sets both); 160 small requests a phase, so those beside
  # span a maximal request's capture, readout and reply (with 40 they covered its capture
  # only, and p99 was the slowest one or two)
  # a stack starts in 127-156 s with the readout warmed up to these limits: one arm a call
  # is safe, two fit only on a warm machine
  for arm in ${ARMS:-chunk512+yield0.5}; do
    env=()
    for part in ${arm//+/ }; do
      case "$part" in
        tokens*) env+=(--env "STATEBLOCK_CAPTURE_PART_TOKENS=${part#tokens}") ;;
        sms*) env+=(--env "STATEBLOCK_CAPTURE_PART_SMS=${part#sms}") ;;
        yield*) env+=(--env "STATEBLOCK_CAPTURE_PART_YIELD_S=${part#yield}") ;;
        chunk*) env+=(--env "STATEBLOCK_CAPTURE_PART_CHUNK_TOKENS=${part#chunk}") ;;
        plane*) env+=(--env "STATEBLOCK_DATA_PLANE=${part#plane}") ;;  # after host: it wins
      esac
    done
    tag=${arm//+/_}  # a name with + does not come back from a device call
    timeout 290 python3 -m bench.load_gpu --out "$OUT/fair-$tag" --levels '' --depths 256 \
      --prompts 32 --big-clients 1 --fairness-requests 160 --ar-batches '' --ar-reserve-s 0 \
      --capture-compile default \
      --env STATEBLOCK_DATA_PLANE=host --env STATEBLOCK_CAPTURE_LANE_BUCKETS=2,8,32 \
      "${env[@]}" --budget-s 280 "${@:2}" > "$OUT/fair-$tag.log" 2>&1
    echo "fairness, $arm: rc=$?"
    grep -A6 '^\*\*Fairness' "$OUT/fair-$tag/load.md"; grep -E '^p99|^Beside' "$OUT/fair-$tag/load.md"
  done
elif [ "$STAGE" = served-eval ]; then  # the shipped pair on the rows the GPU service gives
  # the capture's stream priorities and a part's green context, the readout's beside() view
  # (GPU tests; they load the shipped pair)
  timeout 120 python3 -m pytest -q -rs tests/gpu/test_capture_gpu.py \
    tests/gpu/test_torch_engine_gpu.py -k "priority or green or beside" \
    > "$OUT/priority-test.log" 2>&1
  echo "priority test rc=$?"; tail -3 "$OUT/priority-test.log"
  # EVALS: `off` a masked eager capture, `default` the compiled unmasked one, `table` that
  # one with the rotary table (STATEBLOCK_CAPTURE_ROPE=table)
  for mode in ${EVALS:-default table}; do
    flags=(--capture-compile "$mode")
    [ "$mode" = table ] && flags=(--capture-compile default --capture-rope table)
    timeout 240 python3 -m stateblock.app.cli eval --device cuda --n-each 30 "${flags[@]}" \
      --json "$OUT/eval-$mode.json" --markdown "$OUT/eval-$mode.md" > "$OUT/eval-$mode.log" 2>&1
    echo "eval $mode rc=$?"; grep -E "^\| [0-9]" "$OUT/eval-$mode.md" | head -8
  done
elif [ "$STAGE" = startup ]; then  # a compiled capture's warm-up, fresh, then from its cache
  timeout 560 python3 -m bench.compile_cache --scale full --out "$OUT/startup.json" "${@:2}" \
    > "$OUT/startup.log" 2>&1
  echo "startup rc=$?"
  tail -c 3000 "$OUT/startup.log"
elif [ "$STAGE" = invariance ]; then  # is the compiled capture batch-invariant? JSON in $OUT
  timeout 500 python3 -m bench.capture_invariance --out "$OUT/invariance.json" "${@:2}" \
    > "$OUT/invariance.log" 2>&1
  echo "invariance rc=$?"
  tail -c 3000 "$OUT/invariance.log"
elif [ "$STAGE" = prose ]; then  # summary.json, summary.md, base.part*.safetensors in $OUT
  python3 -m bench.unpack "${2:-.gpu_prose}" && train_ids "${2:-.gpu_prose}" || exit 1
  timeout 500 python3 -m stateblock.train.prose_stage --data "${2:-.gpu_prose}" --out "$OUT" \
    --minutes 6.5 "${@:3}" > "$OUT/prose.log" 2>&1
  echo "prose rc=$?"
  tail -c 3000 "$OUT/prose.log"; cat "$OUT/summary.md"
elif [ "$STAGE" = prose-base ]; then  # a larger base, kept on the machine for prose-chain
  DATA=${2:-.gpu_prose}; t0=$SECONDS
  python3 -m bench.unpack "$DATA" && train_ids "$DATA" || exit 1
  rm -f "$DATA"/base.part*.safetensors
  timeout 545 python3 -m stateblock.train.prose_stage --data "$DATA" --out "$DATA/stage" \
    --minutes 8.5 --epochs 7 --max-checkpoint-mb 1000 "${@:3}" > "$OUT/prose.log" 2>&1
  echo "prose base rc=$? ($((SECONDS - t0)) s)"
  cp "$DATA/stage/summary.json" "$DATA/stage/summary.md" "$OUT/" 2>/dev/null
  cat "$DATA/stage/summary.md"; cp "$DATA"/stage/base.part*.safetensors "$DATA/"
  ls -la "$DATA"/base.part*.safetensors
elif [ "$STAGE" = prose-chain ]; then  # the base, then the pair; DATA kept for prose-more
  DATA=${2:-.gpu_prose}; t0=$SECONDS
  python3 -m bench.unpack "$DATA" && train_ids "$DATA" || exit 1
  if ! ls "$DATA"/base.part*.safetensors > /dev/null 2>&1; then
    # BASE_ARGS: the base's shape (e.g. "--dim 512 --n-layers 10 --mlp-dim 2048 --n-heads
    # 8"), for a larger base in the chain's own call; the readout stage is given it too
    # (--base-shape), so only the shape options base_ddp takes belong there
    timeout 230 python3 -m stateblock.train.prose_stage --data "$DATA" --out "$DATA/stage" \
      --minutes 3 --epochs 7 --max-checkpoint-mb 1000 ${BASE_ARGS:-} > "$OUT/prose.log" 2>&1
    echo "prose base rc=$? ($((SECONDS - t0)) s)"; cat "$DATA/stage/summary.md"
    cp "$DATA"/stage/base.part*.safetensors "$DATA/" || exit 1
  fi
  timeout $((575 - SECONDS + t0)) python3 -m stateblock.train.prose_readout \
    --tokenizer "$DATA/tokenizer" --base-weights "$DATA/base" --work "$DATA/readout" \
    --scale bench --device cuda --corpus "$DATA/corpus" --task-workers "$(nproc)" \
    --tune-prompts 250000 --train-prompts 50000 --tune-minutes 1.5 --distill-minutes 2.5 \
    ${BASE_ARGS:+--base-shape "$BASE_ARGS"} "${@:3}" > "$OUT/prose-readout.log" 2>&1
  echo "prose-readout rc=$? ($((SECONDS - t0)) s)"
  cp "$DATA/readout/summary.json" "$DATA/readout/summary.md" "$OUT/" 2>/dev/null
  pack_pair "$DATA/readout"  # the pair comes back even when no prose-more call follows
  grep '^\[prose\]' "$OUT/prose-readout.log"; cat "$OUT/summary.md" 2>/dev/null
elif [ "$STAGE" = prose-arms ]; then  # readouts side by side on the chain's tuned base+teacher
  DATA=${2:-.gpu_prose}; W="$DATA/readout"; t0=$SECONDS
  [ -f "$W/teacher/train.jsonl" ] || { echo "no teacher in $W (run prose-chain first)"; exit 1; }
  read -r -a arms <<< "${ARMS:-plain twin}"
  for arm in "${arms[@]}"; do  # plain: --copy none; tokens: --row-tokens; else --copy ARM
    tag=${arm//+/_}  # a name with + does not come back from a device call
    A="$DATA/arm-$tag"; rm -rf "$A"; mkdir -p "$A" "$OUT/$tag"
    cp -rl "$W/tuned" "$W/teacher" "$A/"
    case "$arm" in
      plain) copy=(--copy none) ;;
      tokens) copy=(--row-tokens) ;;
      *) copy=(--copy "${arm%%+*}")
         for flag in $(tr + ' ' <<< "${arm#*+}"); do  # MODE+guess+follow+span
           [ "$arm" = "${arm%%+*}" ] && break
           case "$flag" in
             guess) copy+=(--copy-guess 4) ;;
             follow) copy+=(--copy-follow) ;;
             span) copy+=(--copy-span) ;;
             match) copy+=(--copy-match 16) ;;
             ends) copy+=(--copy-match-ends) ;;
             point) copy+=(--copy-point) ;;
           esac
         done ;;
    esac
    timeout $(( (570 - SECONDS + t0) / ${#arms[@]} + 5 )) python3 -m stateblock.train.prose_readout \
      --tokenizer "$DATA/tokenizer" --base-weights "$DATA/base" --work "$A" --scale "${SCALE:-bench}" \
      --device "${DEVICE:-cuda}" --distill-minutes "${MINUTES:-3}" "${copy[@]}" "${@:3}" \
      > "$OUT/$tag/prose-readout.log" 2>&1
    echo "arm $arm rc=$? ($((SECONDS - t0)) s)"
    cp "$A/summary.json" "$A/summary.md" "$OUT/$tag/" 2>/dev/null
    grep '^\[prose\]' "$OUT/$tag/prose-readout.log" | tail -4; cat "$OUT/$tag/summary.md"
    arms=("${arms[@]:1}")
  done
elif [ "$STAGE" = prose-more ]; then  # the last decoder distilled on, from this machine's DATA
  DATA=${2:-.gpu_prose}; W="$DATA/readout"
  [ -f "$W/decoder/manifest.json" ] || { echo "no decoder in $W (run prose-chain first)"; exit 1; }
  prev="$DATA/decoder-prev$(find "$DATA" -maxdepth 1 -name 'decoder-prev*' | wc -l)"
  mv "$W/decoder" "$prev" && rm -f "$W/summary.json" "$W/summary.md" "$W/readouts.jsonl"
  timeout 560 python3 -m stateblock.train.prose_readout --tokenizer "$DATA/tokenizer" \
    --base-weights "$DATA/base" --work "$W" --scale bench --device cuda \
    --distill-init "$prev" --distill-minutes "${3:-7}" "${@:4}" > "$OUT/prose-readout.log" 2>&1
  echo "prose-readout rc=$?"
  cp "$W/summary.json" "$W/summary.md" "$OUT/" 2>/dev/null
  pack_pair "$W"
  grep '^\[prose\]' "$OUT/prose-readout.log"; cat "$OUT/summary.md" 2>/dev/null
elif [ "$STAGE" = prose-readout ]; then  # summary.json, summary.md, the pair's parts in $OUT
  DATA=${2:-.gpu_prose}  # a stage found in DATA/readout (a rerun on this machine) is skipped
  # carried compressed to fit a call: base parts as .xz (bf16 weights shrink about a
  # quarter), the corpus as .gz; with DATA/corpus the train prompts are made here
  python3 -m bench.unpack "$DATA" || exit 1
  corpus=()
  if [ -f "$DATA/corpus/train.txt" ]; then
    corpus=(--corpus "$DATA/corpus" --task-workers "$(nproc)")
  fi
  timeout 545 python3 -m stateblock.train.prose_readout --tokenizer "$DATA/tokenizer" \
    --base-weights "$DATA/base" --work "$DATA/readout" --scale bench --device cuda \
    ${corpus[@]+"${corpus[@]}"} "${@:3}" > "$OUT/prose-readout.log" 2>&1
  echo "prose-readout rc=$?"
  cp "$DATA/readout/summary.json" "$DATA/readout/summary.md" "$OUT/" 2>/dev/null
  # the pair (tuned base and decoder, about 52 MB packed) and the teacher's answers in
  # parts a call returns (15 MiB a file; 8 files, 64 MiB in all): here `cat pair.tar.xz.* |
  # xz -d | tar x` gives tuned/, decoder/ and teacher/, for bench.prose_api's served check
  # and for a call that goes on distilling (--distill-init); the teacher is left out when
  # the whole would not come back
  pack_pair "$DATA/readout"
  grep '^\[prose\]' "$OUT/prose-readout.log"; tail -c 2000 "$OUT/prose-readout.log"
  cat "$OUT/summary.md" 2>/dev/null
elif [ "$STAGE" = smoke ] || [ "$STAGE" = measure ]; then  # timings, the audit, the GPU tests
  smoke_s=300
  if [ "$STAGE" = measure ]; then  # the eval first (about 25 s); the whole under 10 minutes
    timeout 130 python3 -m stateblock.app.cli eval --device cuda --n-each 30 \
      --json "$OUT/eval-cuda.json" --markdown "$OUT/eval-cuda.md" > "$OUT/eval.log" 2>&1
    echo "eval rc=$?"; grep -E "^\| [0-9]" "$OUT/eval-cuda.md" | head -5
    mkdir -p "$OUT/eval100"  # about 75 s for the three on an H200; one archive: 8 files
    for seed in 1234 7 99; do
      timeout 90 python3 -m stateblock.app.cli eval --device cuda --n-each 100 --seed $seed \
        --json "$OUT/eval100/s$seed.json" --markdown "$OUT/eval100/s$seed.md" \
        > "$OUT/eval100-s$seed.log" 2>&1
      echo "eval seed $seed, 100 a family: rc=$?"
    done
    tar czf "$OUT/eval-cuda-100.tgz" -C "$OUT" eval100 && rm -r "$OUT/eval100"
    smoke_s=215
  fi
  timeout $smoke_s python3 -m bench.gpu_smoke --out "$OUT" --skip-checks --audit \
    > "$OUT/smoke.log" 2>&1
  echo "smoke rc=$?"
  timeout 200 python3 -m pytest -q -rs tests/gpu tests/unit/engines/test_torch_engine.py > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest rc=$?"; tail -5 "$OUT/pytest-gpu.log"; grep -A60 '^summary' "$OUT/smoke.log"
elif [ "$STAGE" = checks ]; then
  timeout 240 python3 -m bench.gpu_smoke --out "$OUT" 2>&1 | tee "$OUT/smoke.log"
  timeout 120 python3 -m pytest -q -rs tests/gpu tests/unit/engines/test_torch_engine.py 2>&1 | tee "$OUT/pytest-gpu.log"
  timeout 180 python3 -m stateblock.app.cli audit --engine torch --device cuda \
    --json "$OUT/parity-torch.json" --markdown "$OUT/parity-torch.md" > "$OUT/audit-torch.log" 2>&1
  echo "audit torch rc=$?"; tail -c 400 "$OUT/parity-torch.md" 2>/dev/null
else
  python3 -m bench.e2e_gpu --out "$OUT" --scale full --engine torch --n 50 "${@:2}" 2>&1 |
    tee "$OUT/e2e.log"
fi
# the device tool returns at most 8 files: the logs travel as one archive
(cd "$OUT" && find . -name '*.log' -o -name gpu.txt | tar czf logs.tgz -T - &&
  find . \( -name '*.log' -o -name gpu.txt \) -delete)
ls "$OUT"
