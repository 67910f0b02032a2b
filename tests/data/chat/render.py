#!/usr/bin/env python3
"""Writes expected.txt: each chat template here rendered by Jinja (the jinja2 package, set up as transformers
sets it up: a sandbox with trim_blocks and lstrip_blocks) for a set of conversations, with and without the
generation prompt. tests/test_chat.cpp formats the same conversations with model/chat.cpp and compares.

    python3 tests/data/chat/render.py

The templates taken from GGUF files (the tokenizer vectors' Qwen 2 and Phi-3 vocabularies, the SmolLM2 model)
are first written out beside the others. bos_token renders as nothing (encode adds BOS); eos_token as the
model's EOS text. A conversation a template refuses (raise_exception) is left out for that template.
"""
import os
import random
import struct
import sys

import jinja2.sandbox

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

# Template file -> EOS text of its models.
TEMPLATES = {
    "smollm2.jinja": "<|im_end|>",
    "qwen2-vocab.jinja": "<|endoftext|>",
    "qwen2.5-instruct.jinja": "<|im_end|>",
    "qwen3.jinja": "<|im_end|>",
    "llama-3-instruct.jinja": "<|eot_id|>",
    "phi-3-vocab.jinja": "<|endoftext|>",
    "phi-3.5-mini-instruct.jinja": "<|endoftext|>",
    "gemma-3-it.jinja": "<eos>",
    "mistral-7b-instruct-v0.1.jinja": "</s>",
    "mistral-7b-instruct-v0.2-first.jinja": "</s>",
    "mistral-7b-instruct-v0.3.jinja": "</s>",
}

FROM_GGUF = {
    "smollm2.jinja": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2-vocab.jinja": "tests/data/tokenizer/ggml-vocab-qwen2.gguf",
    "phi-3-vocab.jinja": "tests/data/tokenizer/ggml-vocab-phi-3.gguf",
}

S, U, A = "system", "user", "assistant"
CONVERSATIONS = [
    [(U, "What is 2+2?")],
    [(S, "Be brief."), (U, "Hi")],
    [(S, "You are terse."), (U, "Hello there"), (A, "Hi!"), (U, "How are you?")],
    [(U, "  spaces kept? \n"), (A, " \tyes \n\n"), (U, "\nand\tthese\n")],
    [(U, "a"), (A, "b"), (U, "c"), (A, "d"), (U, "e")],
    [(U, "Think first."), (A, "<think>\nstep one\n</think>\n\nFour."), (U, "And 3+3?")],
    [(U, "Think first."), (A, "<think>\n\nplan\n\n</think>\n\n\nSix.")],
    [(U, "Reply"), (A, "no thinking here")],
    [(S, ""), (U, "empty system")],
    [(S, "First."), (S, "Second system."), (U, "two systems")],
    [(U, "caf\u00e9 \u65e5\u672c \U0001F680 \u00a0nbsp\u00a0")],
    [],
]


def random_conversations(n, seed):
    """Alternating user/assistant turns, sometimes after a system message, whose contents mix letters, ASCII and
    Unicode whitespace (what trim must strip or keep) and reasoning tags."""
    rng = random.Random(seed)
    pieces = ["a", "Hello", "\u00e9", "\u65e5", "\U0001F680", " ", "\t", "\n", "\n\n", "\u00a0", "\u3000", "\x1c",
              "\u2028", "<think>", "</think>", "[INST]", "<|end|>"]
    out = []
    for _ in range(n):
        conv = [(S, "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))))] if rng.random() < 0.4 else []
        for k in range(rng.randint(1, 5)):
            conv.append((U if k % 2 == 0 else A, "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))))
        out.append(conv)
    return out


CONVERSATIONS += random_conversations(40, 7)


def gguf_string(path, key):
    """The value of one string key of a GGUF file (v2/v3 metadata), or None."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = data[pos:pos + n]
        pos += n
        return s.decode("utf-8")

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t):
        nonlocal pos
        if t == 8:
            string()
        elif t == 9:
            et, n = take("I"), take("Q")
            for _ in range(n):
                skip(et)
        else:
            pos += sizes[t]

    assert data[:4] == b"GGUF", path
    pos = 8
    take("Q")
    for _ in range(take("Q")):
        k, t = string(), take("I")
        if k == key and t == 8:
            return string()
        skip(t)
    return None


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def main():
    for name, rel in FROM_GGUF.items():
        text = gguf_string(os.path.join(ROOT, rel), "tokenizer.chat_template")
        if text is None:
            sys.exit(f"render.py: {rel} has no chat template")
        with open(os.path.join(HERE, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    out = []
    n_cases = 0
    for name, eos in TEMPLATES.items():
        with open(os.path.join(HERE, name), encoding="utf-8", newline="") as f:
            template = env.from_string(f.read())
        for conv in CONVERSATIONS:
            messages = [{"role": r, "content": c} for r, c in conv]
            for gen in (1, 0):
                try:
                    text = template.render(messages=messages, add_generation_prompt=bool(gen), bos_token="",
                                           eos_token=eos)
                except (jinja2.exceptions.TemplateError, IndexError):
                    continue
                out.append(f"case {name} {gen} {len(conv)}\n")
                for r, c in conv:
                    out.append(f"message {r} {len(c.encode())}\n{c}\n")
                out.append(f"expect {len(text.encode())}\n{text}\n")
                n_cases += 1
    with open(os.path.join(HERE, "expected.txt"), "w", encoding="utf-8", newline="") as f:
        f.write("".join(out))
    print(f"render.py: {n_cases} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
