#!/usr/bin/env python3
"""vLLM's offline engine on a batch of requests, timed: N requests that share a system prompt of about P tokens
(bench/prompt-1230.txt's words) plus a question each, or (--no-shared) N prompts of the same length that share
nothing; T greedy tokens each. Prints one JSON object: output tokens/s over generate() (prefill included), the
backend vLLM ran, and cascade_vllm's counters when the plugin ran.

    VLLM_PLUGINS="" python bench/vllm_offline.py MODEL_DIR      # vLLM's own CPU attention
    VLLM_PLUGINS=cascade python bench/vllm_offline.py MODEL_DIR # through cascade (integrations/vllm)
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def prompts(n: int, n_words: int, shared: bool) -> list[str]:
    words = (Path(__file__).with_name("prompt-1230.txt")).read_text().split()
    questions = [f"Question {i}: what does part {i} of the text above say about item {3 * i + 1}?" for i in range(n)]
    if shared:
        system = " ".join(words[:n_words])
        return [system + "\n" + q for q in questions]
    out = []
    for i in range(n):  # the same words in another order for each request: same length, nothing shared
        w = words[:n_words]
        random.Random(i).shuffle(w)
        out.append(" ".join(w) + "\n" + questions[i])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=750, help="about 1,000 tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-shared", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cached-prefix", action="store_true",
                    help="put the shared system prompt in the prefix cache before timing")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=True, max_model_len=2048,
              max_num_seqs=args.requests, seed=0, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    batch = prompts(args.requests, args.prompt_words, not args.no_shared)
    if args.cached_prefix and not args.no_shared:
        # A server's state: the system prompt already in the prefix cache (a request before these had it), so the
        # batch prefills only its questions and what is timed is mostly decoding.
        llm.generate([batch[0].split("\n")[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    stats = None
    if "cascade_vllm.backend" in sys.modules:
        stats = dict(sys.modules["cascade_vllm.backend"].stats)
    print(json.dumps({"backend": AttentionBackendEnum.CPU_ATTN.get_path(), "shared": not args.no_shared,
                      "cached_prefix": args.cached_prefix and not args.no_shared,
                      "prompt_tokens": n_in, "output_tokens": n_out, "seconds": round(dt, 2),
                      "output_tok_s": round(n_out / dt, 1), "stats": stats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
