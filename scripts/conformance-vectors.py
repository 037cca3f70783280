#!/usr/bin/env python3
"""Conformance vectors for a model family, written by transformers itself: the evidence
`metainfer ckb conformance DIR` holds a family contract to (a proposed family is promoted only when
its reference reproduces these numbers).

    python3 conformance-vectors.py SOURCE TOKENIZER_DIR OUT [--layers N] [--seed S]

SOURCE is a model directory (its config.json is read; no weights are needed) or a config.json file.
The script keeps the architecture (model_type, every feature key, layer_types, rope_parameters) and
shrinks the sizes to a tiny checkpoint: hidden 64, 4 heads of 16 (key/value heads 4, 2 or 1 as the
original groups them), N layers (default 4; more when layer_types needs them to hold one layer of
each kind), intermediate 128 (32 per expert), 4 experts with 2 per token, a sliding window of 4 where
the original has one, and the vocabulary of TOKENIZER_DIR's tokenizer.json. Weights are drawn with a
fixed seed: every matrix N(0, 1/fan_in), norm gains 1 + N(0, 0.2) (N(0, 0.2) where the family adds
the 1 itself: Gemma), every other vector N(0, 0.1).

OUT receives config.json, generation_config.json and model.safetensors (transformers'
save_pretrained, float32), tokenizer.json (copied), and vectors.json: per prompt its ids, the logits
at every position of one forward pass (float32, CPU, eager attention), the hidden states of that
pass (output_hidden_states: [layers + 1][positions][hidden], with which a failed check names the
layer where a family departs) and 16 greedy tokens (argmax with the KV cache, never stopping at an
end-of-sequence token), with the class and transformers' version. Requires torch and transformers (pip install torch transformers); nothing else of this
project. It never runs inside an engine: engines are built from the contracts only.
"""

import argparse
import inspect
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the big tree and",
    "She said hello to her friend",
    "Tom and Sue went to the park",
]
GREEDY = 16


def shrink(config: dict, vocab: int, layers: int) -> dict:
    """The architecture of `config` at the tiny sizes described in the module docstring."""
    c = dict(config)
    for key in ("quantization_config", "torch_dtype", "transformers_version", "_name_or_path"):
        c.pop(key, None)
    heads = c.get("num_attention_heads", 4) or 4
    kv = c.get("num_key_value_heads", heads) or heads
    c["num_attention_heads"] = 4
    c["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    c["hidden_size"] = 64
    if "head_dim" in c:
        c["head_dim"] = 16
    moe = any(k in c for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    c["intermediate_size"] = 32 if moe else 128
    for key, value in (
        ("moe_intermediate_size", 32),
        ("num_local_experts", 4),
        ("num_experts", 4),
        ("n_routed_experts", 4),
        ("num_experts_per_tok", 2),
    ):
        if key in c:
            c[key] = value
    if c.get("sliding_window"):
        c["sliding_window"] = 4
    kinds = c.get("layer_types")
    if isinstance(kinds, list) and kinds:
        # Enough layers to hold one of each kind the original has, in its order.
        need = max(kinds.index(k) for k in set(kinds)) + 1
        layers = max(layers, need)
        c["layer_types"] = [kinds[i % len(kinds)] for i in range(layers)]
    c["num_hidden_layers"] = layers
    c["vocab_size"] = vocab
    c["max_position_embeddings"] = 128
    c["dtype"] = "float32"
    return c


def init_weights(model, model_type: str, seed: int) -> None:
    """Draw every parameter as the module docstring says."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    one_plus = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-2]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif "norm" in name and name.endswith("weight"):
                gain = torch.randn(p.shape, generator=gen) * 0.2
                p.copy_(gain if one_plus else gain + 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a model directory or a config.json file")
    ap.add_argument("tokenizer_dir", help="a directory with tokenizer.json (its vocabulary sizes the checkpoint)")
    ap.add_argument("out", help="the folder to write (created; must not hold a vectors.json)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        print(
            f"conformance-vectors: {e}. This script needs torch and transformers (pip install torch "
            "transformers); run it where they are installed (a laptop, a GPU machine) and bring OUT back "
            "for `metainfer ckb conformance OUT`.",
            file=sys.stderr,
        )
        return 2
    source = Path(args.source)
    config_path = source / "config.json" if source.is_dir() else source
    tokenizer_json = Path(args.tokenizer_dir) / "tokenizer.json"
    out = Path(args.out)
    for path, what in ((config_path, "config.json"), (tokenizer_json, "tokenizer.json")):
        if not path.is_file():
            print(f"conformance-vectors: no {what} at {path}", file=sys.stderr)
            return 2
    if (out / "vectors.json").exists():
        print(f"conformance-vectors: {out} already holds vectors.json; choose an empty folder", file=sys.stderr)
        return 2
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    config = shrink(json.loads(config_path.read_text()), len(tokenizer), args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        cfg = AutoConfig.from_pretrained(tmp)
    cfg._attn_implementation = "eager"
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    init_weights(model, cfg.model_type, args.seed)
    # The KV cache's name: `cache` from transformers 5.2x on, `past_key_values` before (same
    # object, in the forward's arguments and in its output).
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    # Written to a sibling first and renamed: OUT holds a whole set or nothing.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".vectors-", dir=out.parent))
    model.save_pretrained(staging, safe_serialization=True)
    shutil.copy(tokenizer_json, staging / "tokenizer.json")
    prompts = []
    with torch.no_grad():
        for text in PROMPTS:
            ids = tokenizer(text)["input_ids"]
            if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
                ids = [tokenizer.bos_token_id] + ids
            x = torch.tensor([ids])
            full = model(x, output_hidden_states=True)
            logits = full.logits[0].float()
            hidden = [h[0].float().tolist() for h in full.hidden_states]
            greedy = []
            step = model(x, use_cache=True)
            for _ in range(GREEDY):
                token = int(step.logits[0, -1].argmax())
                greedy.append(token)
                past = step[cache_arg]
                step = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: past})
            prompts.append(
                {
                    "text": text,
                    "ids": ids,
                    "logits": logits.tolist(),
                    "greedy_ids": greedy,
                    "greedy_text": tokenizer.decode(greedy),
                    "hidden_states": hidden,
                }
            )
    vectors = {
        "family": cfg.model_type,
        "class": type(model).__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": args.seed,
        "prompts": prompts,
    }
    (staging / "vectors.json").write_text(json.dumps(vectors))
    if out.exists():
        for f in staging.iterdir():
            shutil.move(str(f), out / f.name)
        staging.rmdir()
    else:
        staging.rename(out)
    print(json.dumps({"out": str(out), "family": cfg.model_type, "class": vectors["class"], "prompts": len(prompts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
