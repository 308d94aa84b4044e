#!/bin/bash
# The engine's GPU checks as one script, for a session lent a GPU for a few minutes (run from the
# repository root; results and logs go to $OUT, default benchmarks/results/gpu-<UTC time>):
#
#   tests    the CUDA tests (test_accelerator.py: fp32/bf16 numerics, compiled, CUDA graphs) and
#            the device experts' and decode graphs' tests                          T_TESTS s (240)
#   graphs   kvcache bench engine --cuda-graphs (v4-small, b1 and b8, bf16)         T_BENCH s (200)
#   bench    the same without CUDA graphs (the A/B)                                 T_BENCH s
#   profile  where a b1 step goes with graphs (kvcache bench decode-profile)        T_PROF s (120)
#
# STEPS picks some (default: all, in this order). Each step has its own time limit, so one that
# hangs or compiles too long costs only its share; all four need ~13 minutes with cold compile
# caches, more than one 10-minute device call: split them, e.g. STEPS="tests graphs" then
# STEPS="bench profile" (TORCHINDUCTOR_CACHE_DIR keeps what the first call compiled, but only
# while the device machine stays warm: it is handed back after ~30 s idle, so make the second
# call at once, or count on compiling cold again).
# On a machine without this package installed: wheels the GPU image lacks (lmdb, zstandard,
# a newer transformers) may sit in .whl/ and are installed offline into /tmp/site first.
# Smoke run without a GPU: DEVICE=cpu CONFIGS=v4-tiny T_TESTS=60 benchmarks/gpu_session.sh
set -u
T0=$(date +%s)
OUT=${OUT:-benchmarks/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
DEVICE=${DEVICE:-cuda}
CONFIGS=${CONFIGS:-v4-small}
STEPS=" ${STEPS:-tests graphs bench profile} "
PY=${PY:-python3}
mkdir -p "$OUT"
say() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/session.log"; }

if ! $PY -c "import kvcache" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { say "offline wheel install failed"; exit 3; }
    fi
    mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kvcache
    export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>&1 | tee -a "$OUT/session.log"

if [[ $STEPS == *" tests "* ]]; then
say "tests"
# KVCACHE_TEST_INDUCTOR: also inductor's CPU code generation (tests/engine/test_compiled.py), which
# the 2-core CI skips because a cold cache compiles for minutes there
KVCACHE_TEST_INDUCTOR=1 timeout "${T_TESTS:-360}" $PY -m pytest -v --durations=10 -p no:cacheprovider \
    tests/engine/test_accelerator.py tests/engine/test_stacked_experts.py tests/engine/test_decode_graphs.py \
    tests/engine/test_compiled.py > "$OUT/tests.log" 2>&1
say "tests exit $? (124: out of time; each test's verdict is in tests.log) : $(tail -1 "$OUT/tests.log")"
fi

for graphs in --cuda-graphs ""; do
    step=bench; [ -n "$graphs" ] && step=graphs
    [[ $STEPS == *" $step "* ]] || continue
    [ "$DEVICE" = cpu ] && [ -n "$graphs" ] && continue        # CUDA graphs need a GPU
    say "bench ${graphs:-without graphs}"
    timeout "${T_BENCH:-200}" $PY -m kvcache.benchmarks.engine --device "$DEVICE" --configs "$CONFIGS" \
        --batches 1,8 --out-dir "$OUT" --no-progress $graphs > "$OUT/bench${graphs}.log" 2>&1
    say "bench exit $? : $(grep -E 'decode_tokens_per_s_vs_hf_b[18] =' "$OUT/bench${graphs}.log" | tr '\n' ' ')"
done

if [ "$DEVICE" != cpu ] && [[ $STEPS == *" profile "* ]]; then
    say "profile"
    timeout "${T_PROF:-120}" $PY -m kvcache.benchmarks.decode_profile --device "$DEVICE" --batch 1 --cuda-graphs \
        --out-dir "$OUT" > "$OUT/profile.log" 2>&1
    say "profile exit $?"
fi
say "done: $OUT"
