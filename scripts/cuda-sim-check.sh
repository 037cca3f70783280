#!/usr/bin/env bash
# Run the CUDA example engine's fused kernels (examples/engines/llama-cuda-bf16/src/kernels.cu) on a
# CPU model of the GPU (scripts/cuda-sim/sim.h) and check their results against f64 loops
# (scripts/cuda-sim/check.cpp): the matrix-vector kernels with their fused RMSNorm, SiLU, RoPE,
# KV-cache write and argmax, the split decode attention, the tensor-core product (mma.sync modelled
# from the PTX ISA's fragment layout), the prefill attention, the paged attention and its RoPE and
# cache write. Needs g++ with C++20 (std::barrier); no GPU, no CUDA toolkit.
#
# The kernels' source is used as it is, with two edits made here on a copy: each `extern __shared__
# T name[];` becomes a pointer to the launch's dynamic shared memory, and the mma.sync inline PTX
# becomes a call of the model's sim::mma_bf16.
#
#   scripts/cuda-sim-check.sh [FILTER]   prints PASS or FAIL per check (those whose group name holds
#                                        FILTER: mv, qkv, head, attn_decode, gemm, attn_prefill,
#                                        paged, rope_store_paged, moe, contract); exit status 0 when all pass
#
# Environment: CXX (default g++), OUT (build directory, default a fresh temporary one, removed),
# KERNELS (the source checked, default the engine's src/kernels.cu), SANITIZE=1 (build with
# AddressSanitizer and UndefinedBehaviorSanitizer: a read or write outside a buffer fails the run;
# about a minute to build).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-}
if [[ -z "$out" ]]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
if ! command -v "${CXX:-g++}" >/dev/null; then
    echo "cuda-sim-check: no C++ compiler ${CXX:-g++}: install g++ (12 or later, for C++20's std::barrier) or set CXX" >&2
    exit 2
fi
python3 - "${KERNELS:-$root/examples/engines/llama-cuda-bf16/src/kernels.cu}" "$out/kernels.cpp" <<'PY'
import re, sys
src = open(sys.argv[1]).read()
src, n_dyn = re.subn(r"extern __shared__ (\w+) (\w+)\[\];", r"\1* \2 = (\1*)sim::dyn_smem.data();", src)
src, n_mma = re.subn(r"asm volatile\((?:.|\n)*?\);", "sim::mma_bf16(d, a0, a1, a2, a3, b0, b1);", src)
if n_dyn < 1 or n_mma != 1:
    sys.exit("kernels.cu changed shape: %d dynamic shared arrays, %d mma blocks (want >= 1 and 1)" % (n_dyn, n_mma))
open(sys.argv[2], "w").write(src)
PY
{
    echo "#include \"$root/scripts/cuda-sim/sim.h\""
    echo "using std::min; using std::max; using std::isinf; using std::isnan;"
    echo "#include \"$out/kernels.cpp\""
    echo "#include \"$root/scripts/cuda-sim/check.cpp\""
} >"$out/all.cpp"
flags=(-std=c++20 -O1 -pthread -w)
[[ "${SANITIZE:-0}" == 1 ]] && flags+=(-g -fsanitize=address,undefined -fno-sanitize-recover=all)
"${CXX:-g++}" "${flags[@]}" -o "$out/check" "$out/all.cpp"
"$out/check" "${1:-}"
