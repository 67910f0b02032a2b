#!/usr/bin/env python3
"""Converts a Llama-family GGUF into a Hugging Face folder (config, tokenizer, bf16 safetensors) vLLM loads.

    python scripts/vllm-model.py IN.gguf OUT_DIR [--dtype bfloat16|float16|float32]

transformers dequantizes the GGUF (it reads it through the gguf package); the quantization marker it leaves on the
model is dropped so that save_pretrained writes plain weights. Needs torch, transformers, gguf and accelerate
(scripts/vllm-setup.sh installs them into build/vllm-venv).
"""

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", help="the GGUF file")
    ap.add_argument("out", help="the folder to write (created; existing files are overwritten)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    if not os.path.isfile(args.gguf):
        print(f"vllm-model: {args.gguf}: no such file", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    dtype = getattr(torch, args.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=dtype)
    except (ValueError, OSError, KeyError) as e:
        print(f"vllm-model: {args.gguf}: transformers cannot load it: {e}", file=sys.stderr)
        return 1
    # The dequantized weights are plain tensors; the marker would make save_pretrained refuse them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.torch_dtype = dtype
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"vllm-model: wrote {args.out} ({model.config.model_type}, {model.num_parameters()} parameters, "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
