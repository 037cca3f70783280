#!/usr/bin/env python3
"""transformers' own LlamaForCausalLM on the GPU as the baseline of the CUDA engine's figures
(scripts/device-check.sh `run`): the same checkpoint (synth's llama3.2-1b preset), bf16 weights and
activations, batch 1.

    python3 hf-bench.py MODEL_DIR eager      decode tok/s (median of 3 runs of 64 new tokens after a
                                             16-token prompt, KV cache, torch.cuda.synchronize around
                                             the timed loop) and time to first token at 16, 128 and
                                             512 prompt tokens (median of 3; logits of the last
                                             position only, then the argmax read on the host)
    python3 hf-bench.py MODEL_DIR compiled   the same through generate() with a static cache and
                                             torch.compile(mode="reduce-overhead"); decode tok/s from
                                             generate(65 new) minus generate(1 new); TTFT at 16 only
                                             (each prompt length compiles anew)

Prints one JSON object on stdout. Prompts are the token ids (7 i + 13 r + 3) mod vocab, as the
engine's profile draws them.
"""

import json
import statistics
import sys
import time

import torch
from transformers import LlamaForCausalLM


def main():
    path, mode = sys.argv[1], sys.argv[2]
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="eager")
    model = model.to("cuda").eval()
    vocab = model.config.vocab_size

    def prompt(n, r):
        return torch.tensor([[(i * 7 + r * 13 + 3) % vocab for i in range(n)]], device="cuda")

    result = {"mode": mode, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import transformers

    result["transformers"] = transformers.__version__

    def last_logits(ids, **kw):
        try:
            return model(ids, use_cache=True, logits_to_keep=1, **kw)
        except TypeError:
            return model(ids, use_cache=True, **kw)

    with torch.no_grad():
        if mode == "eager":

            def decode(r, n_new=64):
                out = last_logits(prompt(16, r))
                past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(n_new):
                    out = model(tok, past_key_values=past, use_cache=True)
                    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                return n_new / (time.perf_counter() - t)

            def ttft(n, r):
                ids = prompt(n, r)
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = last_logits(ids)
                int(out.logits[0, -1].argmax())
                return (time.perf_counter() - t) * 1e3

            decode(99, 8)  # warm-up
            runs = [decode(r) for r in range(3)]
            result["decode_tok_s"] = statistics.median(runs)
            result["decode_runs"] = runs
            result["ttft_ms"] = {}
            for n in (16, 128, 512):
                ttft(n, 99)
                result["ttft_ms"][str(n)] = statistics.median([ttft(n, r) for r in range(3)])
        else:
            model.generation_config.cache_implementation = "static"
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

            def gen(r, n_new):
                ids = prompt(16, r)
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
                torch.cuda.synchronize()
                return time.perf_counter() - t

            t0 = time.perf_counter()
            gen(98, 65)
            gen(99, 65)
            result["compile_s"] = time.perf_counter() - t0
            one = [gen(r, 1) for r in range(3)]
            full = [gen(r, 65) for r in range(3)]
            result["ttft_ms"] = {"16": statistics.median(one) * 1e3}
            result["decode_tok_s"] = 64 / max(1e-9, statistics.median(full) - statistics.median(one))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
