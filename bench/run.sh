#!/usr/bin/env bash
# One bench round on a GPU host: install the .whl/ bundle the way scripts/gpu-offline-test.sh does
# (where there is one), run the named jobs in order, and keep every log and JSON in one folder,
# bench/results/<date>-<device>-<round>/. A failed job is reported and the next one still runs;
# the exit status says whether any failed. bench/results/README.md indexes the claims that stand.
#
# Usage: bench/run.sh [-d DEVICE] [-o DIR] [-p PREFIX] ROUND JOB[=ARGS]...
#   ROUND   the round's name, a letter by habit (a, b, ... q; or a word: dcp)
#   -d      the device part of the folder name (default: from nvidia-smi: h100, h200x2, ...)
#   -o      write into DIR instead (e.g. -o "$OUT" on a machine whose results come back from $OUT)
#   -p      where the wheel bundle is installed (default /tmp/site)
# Jobs (files they write):
#   tests    pytest -m gpu over tests/ (gpu-tests.log); ARGS replace "tests/"
#   compare  gdsckpt-bench --compare on the default state, GPT-2-small (compare.json/.txt/.png)
#   null     gdsckpt-bench --size 4GiB --target null --loops 8 (null.json/.txt)
#   d2h      gdsckpt-bench --size 4GiB --target null-d2h --loops 8 (d2h.json/.txt)
#   disk4g   gdsckpt-bench --size 4GiB --loops 3: durable saves, cold loads, disk probe (disk4g.json/.txt)
#   scale    gdsckpt-bench --size SiB --loops 3 for S = 1GB 4GB 16GB 32GB (scale-S.json, scale.txt; GiB sizes,
#            as these jobs have always measured)
#   train    gdsckpt-bench --train: checkpoints inside a training loop (train.json/.txt)
#   train-ranks  the same under torchrun, one FSDP2 rank per GPU saving through DCP, every
#            method DCP can run (train-ranks.json/.txt/.png)
#   dcp      the 2-GPU DCP tests and bench/probes/dcp_bench.py (gpu-dcp-tests.log, dcp-2gpu.json/.txt);
#            ARGS go to dcp_bench.py
#   NAME     bench/probes/NAME.py (bench/README.md says what each measures) (its JSON, NAME.txt);
#            ARGS are its command line
# ARGS are extra words for that job, quoted as one: 'null=--loops 5 --bs 128M,256M'. Later options
# win, so ARGS can override the defaults above. {dir} in ARGS stands for the round's folder.
# Example: bench/run.sh r tests null d2h 'disk4g=--compare' scale
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
device="" dir="" prefix=/tmp/site
while getopts "d:o:p:h" opt; do
  case $opt in d) device=$OPTARG ;; o) dir=$OPTARG ;; p) prefix=$OPTARG ;; *) usage ;; esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || usage
round=$1; shift
for job in "$@"; do  # refuse a misspelt job before spending GPU time on the others
  name=${job%%=*}
  case $name in tests|compare|null|d2h|disk4g|scale|train|train-ranks|dcp) ;;
    *) [ -f "bench/probes/$name.py" ] || { echo "unknown job: $name" >&2; usage; } ;;
  esac
done

if [ -z "$device" ]; then  # "NVIDIA H100 80GB HBM3" -> h100; two of them -> h100x2
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  device=$(grep -oE '\b[A-Z][0-9]{2,4}\b' <<< "$gpu" | head -1 | tr 'A-Z' 'a-z')
  [ -n "$device" ] || device=$(tr -cs 'A-Za-z0-9' '-' <<< "${gpu:-cpu}" | tr 'A-Z' 'a-z' | sed 's/^-//; s/-$//')
  [ "${count:-0}" -gt 1 ] && device="${device}x$count"
fi
dir=${dir:-bench/results/$(date -u +%F)-$device-$round}
mkdir -p "$dir" || exit

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$prefix" .whl/*.whl || exit
  export PYTHONPATH="$prefix:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export GDSCKPT_CACHE=${GDSCKPT_CACHE:-/tmp/gdsckpt-cache} PYTHONUNBUFFERED=1
scratch=${BENCH_DIR:-/tmp/bench}  # where checkpoints are written: the disk under test
{
  echo "round $round on $device, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "command: bench/run.sh $*"
  nvidia-smi -L 2>/dev/null
  python3 -c "import torch, gdsckpt; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gdsckpt', gdsckpt.__version__)"
} > "$dir/round.txt" 2>&1
cat "$dir/round.txt"

failed=0
status() {  # job name, exit status
  echo "$1 rc=$2"
  [ "$2" = 0 ] || failed=1
}

bench() {  # output name, then gdsckpt-bench arguments
  local out=$1; shift
  python3 -m gdsckpt.bench "$@" --output "$dir/$out.json" > "$dir/$out.txt" 2>&1
  status "$out" $?
  cat "$dir/$out.txt"
}

for job in "$@"; do
  name=${job%%=*} args=()
  if [ "$name" != "$job" ]; then
    spec=${job#*=}
    read -ra args <<< "${spec//\{dir\}/$dir}"
  fi
  echo "== $name ${args[*]}"
  case $name in
    tests)
      python3 -m pytest -q -m gpu -W ignore::DeprecationWarning -W ignore::UserWarning "${args[@]:-tests/}" \
        > "$dir/gpu-tests.log" 2>&1
      status tests $?
      grep -E "passed|failed" "$dir/gpu-tests.log" | tail -3 ;;
    compare) bench compare --compare --plot "$dir/compare.png" --directory "$scratch" "${args[@]}" ;;
    null) bench null --size 4GiB --target null --loops 8 "${args[@]}" ;;
    d2h) bench d2h --size 4GiB --target null-d2h --loops 8 "${args[@]}" ;;
    disk4g) bench disk4g --size 4GiB --loops 3 --directory "$scratch" "${args[@]}" ;;
    train) bench train --train --directory "$scratch" "${args[@]}" ;;
    train-ranks)
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node "$(nvidia-smi -L | grep -c '^GPU')" \
        -m gdsckpt.bench --train --directory "$scratch" --methods none,dcp-sync,dcp-thread,dcp-process,dcp-gdsckpt-sync,dcp-gdsckpt \
        --plot "$dir/train-ranks.png" "${args[@]}" --output "$dir/train-ranks.json" > "$dir/train-ranks.txt" 2>&1
      status train-ranks $?
      grep -v "^\[train\]" "$dir/train-ranks.txt" | tail -25 ;;
    scale)
      for s in 1GB 4GB 16GB 32GB; do
        python3 -m gdsckpt.bench --size "${s%B}iB" --loops 3 --directory "$scratch" "${args[@]}" \
          --output "$dir/scale-$s.json" > "$dir/scale-$s.log" 2>&1
        status "scale $s" $?
        cat "$dir/scale-$s.log" >> "$dir/scale.txt" && rm "$dir/scale-$s.log"
      done
      grep -E "GB  |disk|bw:|vs disk|bit-exact" "$dir/scale.txt" ;;
    dcp)
      # 2 GPUs on one host; NVLink multicast off (NCCL's NVLS and torch's symmetric memory use it)
      NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 -m pytest -q -m gpu -v -s \
        -W ignore::DeprecationWarning tests/dcp/test_dcp_gpu.py > "$dir/gpu-dcp-tests.log" 2>&1
      status "dcp tests" $?
      tail -5 "$dir/gpu-dcp-tests.log"
      python3 bench/probes/dcp_bench.py --out "$dir/dcp-2gpu.json" --dir /tmp/dcp-bench "${args[@]}" \
        > "$dir/dcp-2gpu.txt" 2>&1
      status "dcp bench" $?
      cat "$dir/dcp-2gpu.txt" ;;
    *)
      OUT=$dir python3 "bench/probes/$name.py" "${args[@]}" > "$dir/$name.txt" 2>&1
      status "$name" $?
      tail -20 "$dir/$name.txt" ;;
  esac
done
echo "results in $dir"
exit $failed
