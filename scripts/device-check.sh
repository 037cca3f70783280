#!/usr/bin/env bash
# The GPU checks of the CUDA example engine (examples/engines/llama-cuda-bf16), as one script in three
# steps, for a GPU machine that has CUDA (driver 13), Python with torch and transformers, and no Rust
# toolchain:
#
#   scripts/device-check.sh prepare DIR   here: build the bundles and a stripped metainfer into DIR,
#                                         packed as DIR.tar.xz (what travels)
#   scripts/device-check.sh run DIR       on the GPU machine: unpack DIR.tar.xz (then removed), run every
#                                         bundle there, pack what came of it as DIR.back.tar.xz (or $BACK)
#   scripts/device-check.sh judge DIR     here: unpack DIR.back.tar.xz over DIR, judge and record
#
# What it measures (README, "Gates on a GPU"): the CUDA kernels' kernel tests; verify_generation on
# BabyLlama and on a synthetic Llama of the 1B shape in bf16; profile_engine on the 1B shape (decode
# tokens/s at batch 1 against the HBM roofline, time to first token, the measured copy bandwidth
# against the platform contract's HBM figure); and, as an independent check, transformers' own Llama
# on the same GPU and BabyLlama's weights against the golden output the reference forward pass
# reproduces (tests/it/oracle.rs: reference_forward_reproduces_golden_greedy_ids_and_logits).
#
# Mixture of experts: the CUDA engine declared for model.qwen3_moe (a copy beside DIR), its kernel
# tests (kernel.moe_route and kernel.moe_experts among them), verify and verify_batching on
# transformers' Qwen3-MoE checkpoint (../shared/conformance/qwen3_moe).
#
# Serving on the GPU: verify_batching on BabyLlama (the batched step over the paged KV cache on the
# device against single-sequence references) and serve_engine on the 1B shape (the engine's own
# OpenAI-compatible server, built here, under 1, 4, 16 and 64 concurrent requests: output tok/s,
# TTFT and ITL p50/p99, every answer compared here with the reference's).
#
# Since the second GPU run it also times the engine's time to first token at 16, 128 and 512 prompt
# tokens (a second profile bundle with a 512-token prompt: its prefill_by_len holds 128, 256 and 512),
# replays the decode profile with the CUDA graph switched off (LLAMA_CUDA_GRAPH=0: the launch-by-launch
# fallback, same tokens), and times transformers' own LlamaForCausalLM on the same GPU and 1B shape in
# bf16 as the baseline: eager (decode tok/s, median of 3 runs of 64 new tokens after a 16-token prompt;
# TTFT at 16/128/512), and torch.compile'd with a static cache under a 120 s limit (skipped with a note
# beyond it).
#
# What travels stays under 64 MiB: DIR packed into one xz stream (each bundle's harness binary and the
# small models repeat; the 64 MiB dictionary stores each once), and the 1B checkpoint is not carried
# but synthesised on each side from the same seed and shape, 640 positions (its hash is checked by
# `bundle run --model` and by the read-back). Verify on it is the normal one (32 new tokens, the last
# random prompt to 512): at its 128,256-token vocabulary a whole logits row is 0.5 MB, so verify
# brings back whole rows within 24 MiB (each prompt's first 8 steps, every 37th and the last) and
# every other step's 16 largest logits (VerifyRequest::logits_every). Every step goes on after a
# failure and leaves its output in DIR/logs; `judge` prints a summary table (judging the 1B verify
# replays about 640 positions of the f64 reference here, and each 1B decode profile of 3 runs 384
# decode positions plus two of three prefill-by-length runs (224) and traced runs (256): about 1.5 s
# a position on 2 cores, some 15 and 22 minutes). `run` keeps to a budget
# (BUDGET_S, default 450 s): each step under its own time limit or what is left, the most owed
# first, later ones skipped when time is out, and the outputs packed back whatever happened.
#
# Environment: METAINFER (the binary, default target/debug/metainfer, built when missing),
# METAINFER_LEDGER (the ledger judge records into; prepare and judge must use the same one),
# BUDGET_S (run's time budget in seconds, default 450), BACK (where run packs its outputs and judge
# reads them, default DIR.back.tar.xz), SEED (default 20261201), MODEL_1B_LONG (where the 1B
# checkpoint is synthesised; default DIR/../llama-1b-640 here, /tmp/metainfer-llama-1b-640 on the GPU
# machine), JUDGE_LONG=1 (judge also reads the 512-token profile
# back through the f64 reference, which replays three runs of 520 tokens of a 1B model on this CPU and
# two of three of its prefill and traced runs, some 4,400 positions: nearly two hours;
# without it the summary still reports that bundle's timings from its replies).
set -uo pipefail

step=${1:-}
dir=${2:-}
if [[ -z "$step" || -z "$dir" ]]; then
    sed -n '2,10p' "$0" >&2
    exit 2
fi
# One absolute spelling of DIR (no trailing slash), so every step and sibling path agrees.
dir=$(realpath -m -- "$dir") || exit 2
[[ "$dir" != / ]] || { echo "DIR must not be /" >&2; exit 2; }
seed=${SEED:-20261201}
# The 1B shape (synth's llama3.2-1b preset: hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
# 8192, vocab 128256, bf16) with a 640-position context: verify's long prompt runs to 512 tokens, the
# TTFT profile takes a 512-token prompt plus 8 new tokens.
shape_1b_long=(--preset llama3.2-1b --max-seq 640 --seed "$seed")

# The CUDA engine declared for model.qwen3_moe (its sources otherwise unchanged), beside DIR and not
# carried: prepare writes its bundles from it and judge reads them back against the same sources.
moe_engine() {
    local root=$1 out="$dir-qwen3-moe-engine"
    rm -rf "$out" && mkdir -p "$out" || return 1
    (cd "$root/examples/engines/llama-cuda-bf16" && tar --exclude=./target -cf - .) | (cd "$out" && tar -xf -) || return 1
    sed -i 's/^family = "model.llama"$/family = "model.qwen3_moe"/' "$out/metainfer.toml"
    grep -q '^family = "model.qwen3_moe"$' "$out/metainfer.toml" || return 1
    echo "$out"
}

log() { printf '%s %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$dir/logs/steps.txt" >&2; }
# Run a step, its stdout (JSON) to logs/NAME.json and stderr to logs/NAME.err; record its status.
step_run() {
    local name=$1
    shift
    "$@" >"$dir/logs/$name.json" 2>"$dir/logs/$name.err"
    local rc=$?
    log "$name: exit $rc"
    # 2 or more: the step could not run (bad usage, a missing file, killed); torch.compile's own
    # time limit is expected and reported by the summary instead.
    ((rc >= 2)) && [[ "$name" != hf-1b-compiled ]] && broken+=("$name")
    return $rc
}
broken=()
# In `run`: a step under a time limit of LIMIT seconds or what is left of the run's budget, whichever
# is less (BUDGET_S, default 450 s from the start of `run`, so that the whole run with its unpacking and
# packing fits one device call of 8 minutes). A step due with under 20 s left is skipped: its log says
# so, and it counts as a step that could not run. `timeout` sends SIGTERM to the step's process group;
# metainfer, on SIGTERM, kills the process groups of the harnesses and servers it started (after a
# 2 s grace) before it exits, well within the 5 s before `timeout` sends SIGKILL.
start=$SECONDS
budget=${BUDGET_S:-450}
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "BUDGET_S=$budget: give whole seconds (default 450)" >&2; exit 2; }
timed() { # NAME LIMIT COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$((budget - (SECONDS - start)))
    if ((left < 20)); then
        printf '{"skipped": "out of time: %s s of the %s s budget left"}\n' "$left" "$budget" >"$dir/logs/$name.json"
        log "$name: skipped (out of time, ${left} s left)"
        [[ "$name" != hf-1b-compiled ]] && broken+=("$name")
        return 3
    fi
    ((limit > left)) && limit=$left
    step_run "$name" timeout -k 5 "$limit" "$@"
}

# The figures side by side, read from DIR's bundle replies (timings need no reference) and
# transformers' logs: the engine against transformers eager and compiled, same GPU and shape. `run`
# prints them too, so they reach the device call's output even if its files do not come back.
figures() {
    python3 - "$dir" "$(dirname "$0")/../contracts/platforms/cuda-sm90.toml" <<'PY'
import glob, json, os, statistics, sys, tomllib
d = sys.argv[1]
# The HBM bandwidth of the device the replies name, from platform.cuda-sm90's device models (the
# roofline profile_engine judges by); the H200's when no reply names a device the contract has.
try:
    devices = tomllib.load(open(sys.argv[2], "rb"))["platform"]["gpu"]["devices"]
except Exception:
    devices = []
def replies(bundle):
    out = []
    for p in sorted(glob.glob(os.path.join(d, bundle, "reply.*.json"))):
        try:
            r = json.load(open(p))
        except Exception:
            continue
        if r.get("reply") == "profile":
            out.append(r)
    return out
def med(v):
    return statistics.median(v) if v else None
def load(name):
    try:
        return json.load(open(os.path.join(d, "logs", name)))
    except Exception:
        return {}
rows = []
engine_ttft = {}
engine_decode = {}
for bundle in ["profile-1b", "profile-1b-nograph", "profile-1b-512"]:
    for r in replies(bundle):
        if bundle != "profile-1b-512" and r.get("decode_s_per_token"):
            engine_decode[bundle] = 1.0 / med(r["decode_s_per_token"])
        for p in r.get("prefill_by_len", []):
            if bundle != "profile-1b-nograph" and p["seconds"]:
                engine_ttft[p["len"]] = med(p["seconds"]) * 1e3
eager, compiled = load("hf-1b-eager.json"), load("hf-1b-compiled.json")
names = [(r.get("device") or {}).get("name", "") for r in replies("profile-1b")]
hbm = next((dv["hbm_gbs"]["value"] for n in names for dv in devices if dv["name"] in n), None)
device = next((n for n in names if n), "H200 (assumed)")
if hbm is None:
    hbm = 4800.0
    device += ", not among platform.cuda-sm90's devices: H200's 4,800 GB/s assumed"
# Bytes of bf16 weights read per token at the 1B shape (1,235,814,400 parameters, tied lm_head read once).
roofline = hbm * 1e9 / (2 * 1235814400)
print("\ndevice: %s; HBM roofline %.0f tok/s at %.0f GB/s" % (device, roofline, hbm))
def fmt(v, f="%.1f"):
    return f % v if isinstance(v, (int, float)) else "-"
print("\n| 1B shape, bf16, batch 1 | engine | engine, no CUDA graph | transformers eager | transformers compiled |")
print("|---|---|---|---|---|")
g, ng = engine_decode.get("profile-1b"), engine_decode.get("profile-1b-nograph")
print("| decode tok/s | %s (%s of %.0f) | %s | %s | %s |" % (fmt(g), fmt(g / roofline if g else None, "%.2f"), roofline,
      fmt(ng), fmt(eager.get("decode_tok_s")), fmt(compiled.get("decode_tok_s")) if "decode_tok_s" in compiled else compiled.get("skipped", compiled.get("error", "-"))[:60]))
for n in [16, 128, 512]:
    print("| TTFT %d tokens, ms | %s | | %s | %s |" % (n, fmt(engine_ttft.get(n), "%.2f"),
          fmt((eager.get("ttft_ms") or {}).get(str(n)), "%.2f"), fmt((compiled.get("ttft_ms") or {}).get(str(n)), "%.2f")))
others = sorted(k for k in engine_ttft if k not in (16, 128, 512))
if others:
    print("engine TTFT at other lengths (ms): " + ", ".join("%d: %.2f" % (k, engine_ttft[k]) for k in others))
PY
}

case "$step" in
prepare)
    root=$(cd "$(dirname "$0")/.." && pwd)
    engine=$root/examples/engines/llama-cuda-bf16
    baby=$root/../shared/models/babyllama-105
    bin=${METAINFER:-$root/target/debug/metainfer}
    if [[ ! -x "$bin" ]]; then
        (cd "$root" && cargo build) || exit 2
    fi
    if [[ -e "$dir" && -n "$(ls -A "$dir" 2>/dev/null)" ]]; then
        echo "$dir exists and is not empty" >&2
        exit 2
    fi
    mkdir -p "$dir/logs" "$dir/bin" "$dir/models"
    # A runner key pair for this check: the device machine signs each run (`bundle run --key`), and
    # the ledger judge records into trusts the public key, so the verdicts count as evidence. The
    # secret key travels in DIR: it proves what a key kept out of the agent's reach would only as far
    # as DIR itself is out of its reach (README, Security: bundles).
    "$bin" bundle keygen --out "$dir/runner" >/dev/null || exit 2
    "$bin" bundle trust "$dir/runner/runner.pub" --name "device-check-$(date -u +%Y%m%dT%H%M%S)" || exit 2
    # Debug information is most of the binary's size; the code is the same.
    objcopy --strip-debug "$bin" "$dir/bin/metainfer" || cp "$bin" "$dir/bin/metainfer"
    cp -r "$baby" "$dir/models/babyllama-105"
    cp "$root/scripts/device-check.sh" "$dir/device-check.sh"
    cp "$root/scripts/hf-bench.py" "$dir/hf-bench.py"
    echo "$seed" >"$dir/seed"
    # Names this prepare, so judge refuses the replies of another one (the seed may repeat).
    od -An -tx8 -N8 /dev/urandom | tr -d ' \n' >"$dir/prepare-id"
    step_run write-kt "$bin" test-kernel --engine "$engine" --seed "$seed" --write-bundle "$dir/kt" --json
    step_run write-verify-baby "$bin" verify --engine "$engine" --model "$baby" --seed "$seed" \
        --max-new-tokens 32 --write-bundle "$dir/verify-baby" --json
    model_1b_long=${MODEL_1B_LONG:-$dir/../llama-1b-640}
    if [[ -d "$model_1b_long" ]] || step_run synth-1b-long "$bin" synth "${shape_1b_long[@]}" --out "$model_1b_long" --json; then
        printf '%s\n' "${shape_1b_long[@]}" >"$dir/synth-1b-long.args"
        # The normal verify (its logits rows within 24 MiB, the other steps' largest logits).
        step_run write-verify-1b "$bin" verify --engine "$engine" --model "$model_1b_long" --seed "$seed" \
            --write-bundle "$dir/verify-1b" --json
        # Decode at batch 1 (64 tokens after a 64-token prompt; prefill_by_len: 16, 32, 64 tokens) ...
        step_run write-profile-1b "$bin" profile --engine "$engine" --model "$model_1b_long" --prompt-len 64 \
            --new-tokens 64 --runs 3 --write-bundle "$dir/profile-1b" --json
        # ... and time to first token for long prompts (prefill_by_len: 128, 256, 512 tokens).
        step_run write-profile-1b-512 "$bin" profile --engine "$engine" --model "$model_1b_long" --prompt-len 512 \
            --new-tokens 8 --runs 3 --write-bundle "$dir/profile-1b-512" --json
        # Serving on the GPU: the engine's own server (built here) under load at 1, 4, 16 and 64
        # concurrent requests, the battery's checks, every answer judged here against the reference.
        step_run write-serve-1b "$bin" load-test --engine "$engine" --model "$model_1b_long" --seed "$seed" \
            --concurrency 1,4,16,64 --max-tokens 32 --write-bundle "$dir/serve-1b" --json
    else
        log "1B: verify and profiles not prepared (synth refused the shape; see logs/synth-1b-long.err)"
    fi
    # Mixture of experts: the CUDA engine on transformers' Qwen3-MoE checkpoint (the router, top-k
    # and the selected experts on the device), its kernel tests, verify and verify_batching.
    qwen3_moe=$root/../shared/conformance/qwen3_moe
    if engine_moe=$(moe_engine "$root") && [[ -d "$qwen3_moe" ]]; then
        step_run write-kt-qwen3-moe "$bin" test-kernel --engine "$engine_moe" --seed "$seed" --write-bundle "$dir/kt-qwen3-moe" --json
        step_run write-verify-qwen3-moe "$bin" verify --engine "$engine_moe" --model "$qwen3_moe" --seed "$seed" \
            --max-new-tokens 16 --write-bundle "$dir/verify-qwen3-moe" --json
        # Its batched step (q/k norms and experts row by row) against single-sequence references.
        step_run write-batching-qwen3-moe "$bin" verify-batching --engine "$engine_moe" --model "$qwen3_moe" --seed "$seed" \
            --write-bundle "$dir/batching-qwen3-moe" --json
    else
        log "qwen3_moe: not prepared (no ../shared/conformance/qwen3_moe, or the engine copy failed)"
    fi
    # The batched step on the device against single-sequence references (block manager, scheduler,
    # and a batched run of mixed prefill chunks and decode tokens over the paged cache).
    step_run write-batching-baby "$bin" verify-batching --engine "$engine" --model "$baby" --seed "$seed" \
        --write-bundle "$dir/batching-baby" --json
    # A written bundle is "not run" (exit 1 above); one attempted and missing is a failed prepare.
    missing=()
    for b in kt verify-baby batching-baby kt-qwen3-moe verify-qwen3-moe batching-qwen3-moe verify-1b profile-1b profile-1b-512 serve-1b; do
        [[ -f "$dir/logs/write-$b.json" ]] || continue
        if [[ -f "$dir/$b/bundle.json" ]]; then log "$b: written"; else missing+=("$b"); fi
    done
    if ((${#missing[@]})); then
        log "not written: ${missing[*]} (see logs/write-*.err); nothing packed"
        exit 1
    fi
    # Every bundle holds its own harness binary and the small models, so DIR itself is larger than
    # what may travel; one xz stream with a 64 MiB dictionary stores each repeated file once.
    size=$(du -sm "$dir" | cut -f1)
    rm -f "$dir.tar.xz"
    tar -C "$dir" -cf - . | xz -9 -T1 >"$dir.tar.xz" || exit 2
    packed=$(du -sm "$dir.tar.xz" | cut -f1)
    log "prepared $dir: ${size} MiB, packed as $dir.tar.xz: ${packed} MiB (carry the .tar.xz)"
    if ((packed > 60)); then
        log "over 60 MiB packed: too large to carry with the repository"
        exit 1
    fi
    ;;
run)
    # Where the outputs go, resolved before anything changes directory; never inside DIR (tar would
    # read the archive it writes).
    back=$(realpath -m -- "${BACK:-$dir.back.tar.xz}")
    [[ "$back" != "$dir"/* ]] || { echo "BACK=$back lies inside $dir: put it beside it (or in \$OUT)" >&2; exit 2; }
    if [[ -f "$dir.tar.xz" ]]; then
        if [[ -e "$dir" ]]; then
            echo "$dir exists beside $dir.tar.xz: remove it to run the archive, or remove the archive to run $dir as it is" >&2
            exit 2
        fi
        # Unpacked beside DIR and renamed into place only when whole.
        rm -rf "$dir.unpacking" && mkdir -p "$dir.unpacking" && tar -C "$dir.unpacking" -xJf "$dir.tar.xz" &&
            mv "$dir.unpacking" "$dir" || { rm -rf "$dir.unpacking"; echo "cannot unpack $dir.tar.xz" >&2; exit 2; }
        rm -f "$dir.tar.xz"
    fi
    cd "$dir" || exit 2
    [[ -x bin/metainfer && -f runner/runner.key && -f prepare-id ]] || { echo "$dir is not a prepared device-check folder" >&2; exit 2; }
    chmod 600 runner/runner.key
    key=(--key "$dir/runner/runner.key")
    mkdir -p logs
    cp prepare-id logs/prepare-id
    bin=$dir/bin/metainfer
    nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv >logs/device.csv 2>&1
    log "device: $(tail -n +2 logs/device.csv | head -1)"
    # Most owed first, so that a run cut short by its budget still gives the figures that matter:
    # the kernels, verify and the decode/TTFT profile on the 1B shape, serving, transformers eager;
    # then batching, mixture of experts, the no-graph replay and the other transformers checks.
    bundle_step() { # NAME LIMIT BUNDLE [--model DIR]
        local name=$1 limit=$2 b=$3
        shift 3
        [[ -d "$b" ]] && timed "$name" "$limit" "$bin" bundle run "$b" "$@" "${key[@]}" --json
    }
    bundle_step run-kt 120 kt
    bundle_step run-verify-baby 120 verify-baby
    model_1b_long=${MODEL_1B_LONG:-/tmp/metainfer-llama-1b-640}
    have_long=0
    if [[ -f synth-1b-long.args ]]; then
        mapfile -t args <synth-1b-long.args
        [[ -d "$model_1b_long" ]] || timed synth-1b-long 180 "$bin" synth "${args[@]}" --out "$model_1b_long" --json
        [[ -f "$model_1b_long/model.safetensors" ]] && have_long=1
    fi
    if ((have_long)); then
        bundle_step run-verify-1b 120 verify-1b --model "$model_1b_long"
        bundle_step run-profile-1b 120 profile-1b --model "$model_1b_long"
        bundle_step run-profile-1b-512 120 profile-1b-512 --model "$model_1b_long"
        bundle_step run-serve-1b 180 serve-1b --model "$model_1b_long"
        # transformers' own Llama on the same GPU, shape and weights (bf16, eager), as the baseline.
        timed hf-1b-eager 200 python3 "$dir/hf-bench.py" "$model_1b_long" eager
    fi
    bundle_step run-batching-baby 120 batching-baby
    bundle_step run-kt-qwen3-moe 120 kt-qwen3-moe
    bundle_step run-verify-qwen3-moe 120 verify-qwen3-moe
    bundle_step run-batching-qwen3-moe 120 batching-qwen3-moe
    if ((have_long)) && [[ -d profile-1b ]]; then
        # The decode profile again with the CUDA graph off (a copy, judged like the original).
        rm -rf profile-1b-nograph && cp -r profile-1b profile-1b-nograph
        timed run-profile-1b-nograph 120 env LLAMA_CUDA_GRAPH=0 "$bin" bundle run profile-1b-nograph \
            --model "$model_1b_long" "${key[@]}" --json
    fi
    # transformers' own Llama on this GPU, on BabyLlama's weights: greedy ids and the logits of the
    # first three positions of the golden prompt (written here, compared by `judge`).
    timed hf-babyllama 150 python3 - "$dir/models/babyllama-105" <<'PY'
import json, sys
import torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).to("cuda").eval()
prompt_ids = [1, 3, 34, 9, 22, 4, 3, 18, 20, 7, 9, 3, 5, 3, 6, 10, 16, 4]
ids = torch.tensor([prompt_ids], device="cuda")
with torch.no_grad():
    logits = model(ids).logits[0, :3].float().cpu().tolist()
    out = model.generate(ids, max_new_tokens=103, do_sample=False, eos_token_id=None)
print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "logits_positions_0_to_2": logits, "greedy_ids": out[0].tolist()}))
PY
    # Last, with what is left: torch.compile (its own time limit is expected, and the summary says so).
    if ((have_long)); then
        timed hf-1b-compiled 150 python3 "$dir/hf-bench.py" "$model_1b_long" compiled
        [[ -s logs/hf-1b-compiled.json ]] || echo '{"skipped": "torch.compile did not finish within its time limit (or failed: logs/hf-1b-compiled.err)"}' >logs/hf-1b-compiled.json
    fi
    # The figures first, so they reach the call's output even if packing fails.
    figures
    # What comes back: the replies, records and logs only (logs/prepare-id names the prepare), never what
    # went there (binaries, models, keys, requests): judge unpacks them over the prepared DIR.
    tar -C "$dir" --exclude=./bin --exclude=./models --exclude=./runner --exclude=./seed --exclude=./prepare-id --exclude='./*.args' \
        --exclude=./device-check.sh --exclude=./hf-bench.py --exclude='./*/harness' --exclude='./*/model' \
        --exclude='./*/bundle.json' --exclude='./*/request.*' --exclude='./*/plan.json' --exclude='./*/case*.in.safetensors' \
        --exclude='./*/vocab.*' -cf - . | xz -6 -T0 >"$back" || exit 2
    log "run done: $back $(du -sm "$back" | cut -f1) MiB"
    if ((${#broken[@]})); then
        log "steps that could not run (exit 2 or more): ${broken[*]}"
        exit 2
    fi
    ;;
judge)
    root=$(cd "$(dirname "$0")/.." && pwd)
    engine=$root/examples/engines/llama-cuda-bf16
    baby=$root/../shared/models/babyllama-105
    bin=${METAINFER:-$root/target/debug/metainfer}
    back=$(realpath -m -- "${BACK:-$dir.back.tar.xz}")
    [[ -f "$dir/prepare-id" ]] || { echo "$dir is not a prepared device-check folder" >&2; exit 2; }
    if [[ -f "$back" ]]; then
        came=$(tar -xJf "$back" -O ./logs/prepare-id 2>/dev/null)
        if [[ "$came" != "$(cat "$dir/prepare-id")" ]]; then
            echo "$back comes from another prepare (${came:-no id}; this one is $(cat "$dir/prepare-id")): not unpacked" >&2
            exit 2
        fi
        tar -C "$dir" -xJf "$back" || exit 2
    elif ! compgen -G "$dir/*/reply.*.json" >/dev/null; then
        echo "no $back and no replies in $dir: run it where the device is first" >&2
        exit 2
    fi
    # The copy run without the CUDA graph came back with its outputs only: its inputs are its
    # original's, file for file.
    if [[ -d "$dir/profile-1b-nograph" && -d "$dir/profile-1b" ]]; then
        (cd "$dir/profile-1b" && for f in harness model bundle.json request.* case*.in.safetensors vocab.*; do
            [[ -e "$f" && ! -e "../profile-1b-nograph/$f" ]] && cp -r "$f" "../profile-1b-nograph/$f"
        done)
    fi
    mkdir -p "$dir/logs"
    seed=$(cat "$dir/seed")
    step_run judge-kt "$bin" test-kernel --engine "$engine" --from-bundle "$dir/kt" --json
    step_run judge-verify-baby "$bin" verify --engine "$engine" --model "$baby" --max-new-tokens 32 \
        --from-bundle "$dir/verify-baby" --json
    model_1b_long=${MODEL_1B_LONG:-$dir/../llama-1b-640}
    if [[ -d "$dir/verify-1b" ]]; then
        step_run judge-verify-1b "$bin" verify --engine "$engine" --model "$model_1b_long" \
            --from-bundle "$dir/verify-1b" --json
    fi
    for b in profile-1b profile-1b-nograph; do
        [[ -d "$dir/$b" ]] && step_run "judge-$b" "$bin" profile --engine "$engine" --model "$model_1b_long" \
            --prompt-len 64 --new-tokens 64 --runs 3 --from-bundle "$dir/$b" --json
    done
    if [[ -d "$dir/verify-qwen3-moe" ]] && engine_moe=$(moe_engine "$root"); then
        step_run judge-kt-qwen3-moe "$bin" test-kernel --engine "$engine_moe" --from-bundle "$dir/kt-qwen3-moe" --json
        step_run judge-verify-qwen3-moe "$bin" verify --engine "$engine_moe" --model "$root/../shared/conformance/qwen3_moe" \
            --max-new-tokens 16 --from-bundle "$dir/verify-qwen3-moe" --json
        [[ -d "$dir/batching-qwen3-moe" ]] && step_run judge-batching-qwen3-moe "$bin" verify-batching --engine "$engine_moe" \
            --model "$root/../shared/conformance/qwen3_moe" --from-bundle "$dir/batching-qwen3-moe" --json
    fi
    step_run judge-batching-baby "$bin" verify-batching --engine "$engine" --model "$baby" \
        --from-bundle "$dir/batching-baby" --json
    # The reference's answers to the serving plan on the 1B shape are computed here (f64, slow).
    [[ -d "$dir/serve-1b" ]] && step_run judge-serve-1b "$bin" load-test --engine "$engine" --model "$model_1b_long" \
        --concurrency 1,4,16,64 --max-tokens 32 --from-bundle "$dir/serve-1b" --json
    if [[ -d "$dir/profile-1b-512" && "${JUDGE_LONG:-0}" == 1 ]]; then
        step_run judge-profile-1b-512 "$bin" profile --engine "$engine" --model "$model_1b_long" \
            --prompt-len 512 --new-tokens 8 --runs 3 --from-bundle "$dir/profile-1b-512" --json
    fi
    # transformers on the GPU against the golden output (agreed by four implementations; the
    # reference forward pass reproduces it in tests/it/oracle.rs). f32 logits: 1e-4 absolute.
    step_run judge-hf python3 - "$dir/logs/hf-babyllama.json" "$root/../shared/golden/babyllama-105-once-upon-a-time.json" <<'PY'
import json, sys
try:
    hf = json.load(open(sys.argv[1]))
except Exception as e:
    print(json.dumps({"passed": False, "error": f"no transformers output: {e}"}))
    sys.exit(1)
golden = json.load(open(sys.argv[2]))
diff = max(abs(a - b) for hr, gr in zip(hf["logits_positions_0_to_2"], golden["logits_positions_0_to_2"])
           for a, b in zip(hr, gr))
n = len(golden["greedy_ids"])
same_ids = hf["greedy_ids"][:n] == golden["greedy_ids"]
passed = same_ids and diff <= 1e-4
print(json.dumps({"passed": passed, "device": hf["device"], "max_abs_logit_diff": diff, "greedy_ids_equal": same_ids}))
sys.exit(0 if passed else 1)
PY
    echo "summary (passed / key figures):"
    python3 - "$dir"/logs/judge-*.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    name = path.rsplit("/", 1)[-1][len("judge-"):-len(".json")]
    try:
        r = json.load(open(path))
    except Exception:
        print("  %s: no report" % name)
        continue
    d = r.get("device") or {}
    extra = ""
    if "decode_tok_s" in r:
        extra = " decode %.1f tok/s, roofline %.1f, fraction %.2f, TTFT %.1f ms, copy %.0f / HBM %.0f GB/s" % (
            r["decode_tok_s"]["median"], r["roofline_decode_tok_s"], d.get("decode_fraction", 0.0),
            r["first_token_ms"]["median"], d.get("copy_gbs", 0.0), d.get("hbm_gbs", 0.0))
    if "max_abs_logit_diff" in r:
        extra = " on %s: max |logit diff| %.2e, greedy ids equal %s" % (r["device"], r["max_abs_logit_diff"], r["greedy_ids_equal"])
    for lv in r.get("levels") or []:
        extra += "\n    c%s: %s" % (lv.get("concurrency"), ", ".join("%s %s" % (k, v) for k, v in lv.items()
                                                       if k != "concurrency" and isinstance(v, (int, float))))
    err = r.get("error") or r.get("build_error") or ""
    print("  %s: passed=%s%s%s" % (name, r.get("passed"), extra, (" -- " + err[:200]) if err else ""))
PY
    # The figures side by side (see figures).
    figures
    if ((${#broken[@]})); then
        log "judge steps that could not run (exit 2 or more): ${broken[*]}"
        exit 2
    fi
    ;;
*)
    sed -n '2,12p' "$0" >&2
    exit 2
    ;;
esac
