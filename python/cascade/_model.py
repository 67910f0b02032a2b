"""Generation on a GGUF model: ``cascade.Model`` and what its ``generate`` returns (``cascade.Generation``).
The package's ``__init__`` re-exports both; this module keeps the imports they need out of its namespace."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Optional, Sequence, Union

from . import _cascade
from ._cascade import CostModel


@dataclasses.dataclass
class Generation:
    """What ``Model.generate`` returns. Sequence i continues prompt ``prompt[i]``; sequences are laid out
    prompt after prompt, n each."""

    texts: list  # per sequence: the generated text (without the prompt)
    tokens: list  # per sequence: the generated token ids (without the end-of-generation token)
    prompt: list  # per sequence: the index of its prompt
    stop: list  # per sequence: "eog", "length" or "context"
    timings: dict  # prompt_ms, decode_ms, decode_tokens_per_s, step_ms (per decode step), attention and plan times
    n_prompt_tokens: int  # tokens in all prompts
    n_prompt_stored: int  # of them, stored once in the shared prompt tree
    n_decode_tokens: int
    n_ctx: int
    kv_tokens: int  # K/V tokens stored at the end (each copy counted)
    kv_bytes: int
    seed: int  # the sampling seed used (random when none was given)
    cost_model: Optional[CostModel]  # attn='auto': the profile used (given, cached or calibrated), else None
    profile_source: Optional[str]  # where cost_model came from: "given", "cache" or "calibrated"; else None
    profile_path: Optional[str]  # the cache file read or written, else None


class Model:
    """A Llama-style GGUF model (f32/f16/bf16/Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K tensors) and its tokenizer."""

    def __init__(self, path: Union[str, os.PathLike]):
        self._m = _cascade._Model(os.fspath(path))

    @property
    def path(self) -> str:
        return self._m.path

    @property
    def hparams(self) -> dict:
        """n_vocab, n_ctx_train, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff."""
        return self._m.hparams

    def tokenize(self, text: str, chat: bool = False) -> list:
        """The token ids of text (with the model's BOS; chat=True wraps it in the chat template first)."""
        return self._m.tokenize(text, chat)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._m.detokenize(list(ids))

    def generate(
        self,
        prompts: Union[str, Sequence[str]],
        n: int = 4,
        max_tokens: int = 64,
        *,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        seed: Optional[int] = None,
        attn: str = "auto",
        chat: bool = False,
        ignore_eos: bool = False,
        n_ctx: int = 0,
        threads: int = 0,
        batch_size: int = 512,
        kv_type: str = "float16",
        cost_model: Optional[CostModel] = None,
        recalibrate: bool = False,
    ) -> Generation:
        """n continuations of each prompt, decoded in parallel with the attention method ``attn``
        ('auto', 'cascade', 'split' or 'unified'); prompts that share a beginning share it in the K/V cache.

        A sequence stops at an end-of-generation token (unless ignore_eos), after max_tokens tokens, or at
        the context's end (n_ctx positions, 0: the model's). temperature 0 is greedy; seed None draws one.
        kv_type: the K/V cache's element type, 'float16' (the default), 'bfloat16' (multiplied on bf16 dot
        products where the CPU runs them faster than f32 FMAs), 'q8_0' (int8 codes and an f16 scale per 32
        values, 1.0625 bytes an element, as llama.cpp's -ctk q8_0 -ctv q8_0) or 'float32'.
        cost_model: auto's profile (CostModel). Without one, auto reads this machine's profile from the cache
        ($XDG_CACHE_HOME/cascade, else ~/.cache/cascade; the file cascade-generate uses) or, the first time,
        calibrates it (about 0.3 s) and keeps it there; recalibrate=True measures it anew. A cache that
        cannot be read or written is a RuntimeWarning, and the run calibrates for itself.
        The GIL is released while it runs; Ctrl-C (KeyboardInterrupt) stops it after the current prefill pass
        (at most batch_size prompt tokens) or decode step and leaves the model usable."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts: expected a str or a list of str")
        if seed is not None and not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), got {seed}")
        r = self._m.generate(
            list(prompts), n, max_tokens, temperature, top_k, top_p, min_p, seed, attn, chat, ignore_eos,
            n_ctx, threads, batch_size, kv_type, cost_model, recalibrate,
        )
        note = r.pop("profile_note")
        if note:
            warnings.warn(f"cascade: {note}", RuntimeWarning, stacklevel=2)
        return Generation(**r)

    def __repr__(self) -> str:
        hp = self.hparams
        return (f"Model({self.path!r}, {hp['n_layer']} layers, heads {hp['n_head']}/{hp['n_head_kv']}/"
                f"{hp['head_dim']}, vocab {hp['n_vocab']})")


Generation.__module__ = Model.__module__ = "cascade"  # as users name them
