"""Runs vLLM's offline engine on prompts and writes what it generated as JSON (the tests' driver).

    python run_llm.py MODEL_DIR PROMPTS_JSON OUT_JSON [--max-tokens N] [--dtype D]

Runs in its own process so that each run loads the plugins VLLM_PLUGINS allows (all of them when unset, none
when empty). Writes per prompt the token ids and, per step, the top logprobs; and cascade_vllm's counters when
the plugin ran (the engine runs in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--max-batched-tokens", type=int, default=4096, help="tokens per step (chunked prefill)")
    ap.add_argument("--pipeline-parallel", type=int, default=1,
                    help="workers, each a range of layers in a process of its own (vLLM's multiprocess executor)")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="workers, each a share of every layer's heads in a process of its own")
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    prompts = json.load(open(args.prompts))
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=True,
              max_model_len=2048, max_num_seqs=16, seed=0,
              max_num_batched_tokens=args.max_batched_tokens, pipeline_parallel_size=args.pipeline_parallel,
              tensor_parallel_size=args.tensor_parallel,
              distributed_executor_backend="mp" if args.pipeline_parallel * args.tensor_parallel > 1 else None)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs, ignore_eos=True)
    results = []
    for outs in llm.generate(prompts, params, use_tqdm=False):
        c = outs.outputs[0]
        steps = [{str(t): lp.logprob for t, lp in d.items()} for d in c.logprobs]
        results.append({"tokens": list(c.token_ids), "logprobs": steps})
    backend = AttentionBackendEnum.CPU_ATTN.get_path()
    stats = None
    if "cascade_vllm" in sys.modules:
        from cascade_vllm.backend import stats as s
        stats = dict(s)
    json.dump({"backend": backend, "results": results, "stats": stats}, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
