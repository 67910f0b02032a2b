"""Layers cascade does not cover stay on vLLM's CPU attention, each reason logged once."""

import logging
import types

import pytest
import torch

import cascade_vllm.backend as backend
import vllm.v1.attention.backends.cpu_attn as cpu_attn


@pytest.fixture
def make_impl(monkeypatch):
    # vLLM's impl reads the model dtype from the current config; a bare one suffices outside an engine.
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
    monkeypatch.setattr(backend, "_announced", set())

    def make(**kw):
        args = dict(num_heads=9, head_size=64, scale=0.125, num_kv_heads=3, alibi_slopes=None, sliding_window=None,
                    kv_cache_dtype="auto")
        return backend.CascadeAttentionBackendImpl(**(args | kw))
    return make


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("kw, reason", [
    ({"sliding_window": 4096}, "a sliding window"),
    ({"kv_cache_dtype": "fp8"}, "K/V cache dtype fp8"),
    ({"alibi_slopes": [0.5] * 9}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "a logit soft cap"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only"),
])
def test_unsupported_layers_hand_over_with_one_line(make_impl, kw, reason):
    lines = Lines()
    logger = logging.getLogger("vllm.cascade_vllm")
    logger.addHandler(lines)
    try:
        impls = [make_impl(**kw) for _ in range(3)]
    finally:
        logger.removeHandler(lines)
    assert all(i.cascade_reason == reason for i in impls)
    assert len(lines.lines) == 1 and reason in lines.lines[0]


def test_plain_layer_runs_cascade(make_impl):
    assert make_impl().cascade_reason is None
    assert make_impl(kv_cache_dtype="auto", num_heads=8, num_kv_heads=8).cascade_reason is None
