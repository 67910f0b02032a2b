"""CPU_ATTN through cascade: vLLM's CPU attention backend with its attention computed by cascade plans.

The metadata builder turns each step's block tables into one cascade tree (shared spans found from identical
block ids); every layer runs the step's plan on vLLM's own cache buffer, read in place through a strided token
view. Layers cascade does not cover (a quantized cache, a sliding window, ALiBi, a logit soft cap, attention
sinks, encoder or cross attention) and steps it does not cover (non-causal or dynamic-causal masks) run vLLM's
own kernels, announced by one log line per reason.
"""

import json
import os
from dataclasses import dataclass, field

import torch

import cascade
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .step import StepTree, build_step_tree

# Under vLLM's logger (configured by importing vllm.logger), so that its handlers and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.cascade_vllm")

# What ran in this process, for tests and logs: steps planned; steps whose tree shares a segment and the most
# shared segments in one; steps with a prompt chunk (more than one query token) after cached or earlier-computed
# tokens, and steps mixing prompt chunks with decodes; layer runs through cascade and handed to vLLM's kernels.
stats = {"steps": 0, "shared_steps": 0, "max_shared": 0, "chunked_prefill_steps": 0, "mixed_steps": 0,
         "cascade_layer_runs": 0, "fallback_layer_runs": 0}
_announced: set[str] = set()
# CASCADE_VLLM_STATS_DIR: each process writes its counters to DIR/PID.json at every step it plans, so that a test
# sees them from workers in processes of their own (tensor or pipeline parallel).
_stats_dir = os.environ.get("CASCADE_VLLM_STATS_DIR")


def _publish_stats() -> None:
    if _stats_dir:
        path = os.path.join(_stats_dir, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(path + ".tmp", path)


def _announce_fallback(reason: str) -> None:
    if reason not in _announced:
        _announced.add(reason)
        logger.warning("cascade_vllm: %s; vLLM's CPU attention runs it", reason)


def _threads() -> int:
    """cascade's threads per plan: CASCADE_VLLM_THREADS, default 1 (the calling thread). vLLM's CPU worker keeps
    its OpenMP threads bound to the cores and spinning between regions; a second pool of workers on the same cores
    waits for their time slices."""
    return int(os.environ.get("CASCADE_VLLM_THREADS", "1"))


def _method() -> str:
    m = os.environ.get("CASCADE_VLLM_METHOD", "cascade")
    if m not in ("cascade", "auto"):
        raise ValueError(f"CASCADE_VLLM_METHOD={m!r}: expected cascade or auto")
    return m


def cache_view(kv_cache: torch.Tensor, which: int) -> torch.Tensor:
    """Keys (which=0) or values (1) of a [blocks, heads, block_size, 2 * dim] cache, as write_kv lays each block
    out, as one (tokens, heads, dim) tensor over the same memory: token tau = block * 2 * block_size + offset (see
    step.token_start), heads side by side in a token's row; no copy. Keys' and values' rows alternate block by block,
    so a segment never spans two blocks."""
    n_blocks, n_heads, block_size, two_dim = kv_cache.shape
    dim = two_dim // 2
    n_tokens = n_blocks * 2 * block_size - block_size
    return kv_cache.as_strided((n_tokens, n_heads, dim), (n_heads * dim, dim, 1),
                               kv_cache.storage_offset() + which * block_size * n_heads * dim)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key[i], value[i] ((n_kv_heads, dim) each) at slot slot_mapping[i] (block * block_size + offset;
    negative: padding, skipped) of a [blocks, heads, block_size, 2 * dim] cache, each block laid out as
    [2, block_size, heads, dim]: its keys token by token, every token's heads side by side, then its values (the
    layout cascade's CPU kernels stream best). vLLM's own kernels read another layout (a block's keys and values
    head by head, keys packed for their products), so a layer's cache is written and read by one side only."""
    n = slot_mapping.shape[0]
    n_blocks, n_heads, block_size, two_dim = kv_cache.shape
    key, value = key[:n], value[:n]
    keep = slot_mapping >= 0
    slots = slot_mapping
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    rows = slots + blocks * block_size  # block * 2 * block_size + offset
    flat = kv_cache.view(n_blocks * 2 * block_size, n_heads, two_dim // 2)
    flat.index_copy_(0, rows, key.to(kv_cache.dtype))
    flat.index_copy_(0, rows + block_size, value.to(kv_cache.dtype))


@dataclass
class CascadeStep:
    """A step's tree and, per (scale, cache dtype) the layers run with, its plan (made at the first such layer)."""
    tree: StepTree
    n_rows: int
    plans: dict = field(default_factory=dict)


@dataclass
class CascadeAttentionMetadata(CPUAttentionMetadata):
    cascade_step: CascadeStep | None = None


class CascadeAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta = CascadeAttentionMetadata(**{f: getattr(base, f) for f in base.__dataclass_fields__})
        if self.is_cross_attention or self.is_encoder_only_attention:
            return meta
        if not isinstance(meta.causal, bool) or not meta.causal or meta.dynamic_causal is not None:
            _announce_fallback("a non-causal or dynamic-causal step")
            return meta
        meta.cascade_step = self._step(common_attn_metadata)
        return meta

    def _step(self, cm) -> CascadeStep | None:
        n_reqs = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: n_reqs + 1].tolist()
        seq_lens = cm.seq_lens[:n_reqs].tolist()
        query_lens = [qsl[i + 1] - qsl[i] for i in range(n_reqs)]
        n_blocks = [-(-n // self.block_size) for n in seq_lens]
        rows = cm.block_table_tensor[:n_reqs, : max(n_blocks)].tolist()
        tree = build_step_tree(seq_lens, query_lens, rows, self.block_size)
        stats["steps"] += 1
        prefills = [q > 1 for q in query_lens]
        stats["chunked_prefill_steps"] += any(q > 1 and n > q for q, n in zip(query_lens, seq_lens))
        stats["mixed_steps"] += any(prefills) and not all(prefills)
        if tree.n_shared:
            stats["shared_steps"] += 1
            stats["max_shared"] = max(stats["max_shared"], tree.n_shared)
        _publish_stats()  # the layer runs counted so far: the steps before this one
        return CascadeStep(tree, qsl[n_reqs])


class CascadeAttentionBackendImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cascade_reason = self._unsupported()
        if self.cascade_reason:
            _announce_fallback(self.cascade_reason)

    def _unsupported(self) -> str | None:
        if self.attn_type != AttentionType.DECODER:
            return f"attention type {self.attn_type}"
        if self.is_fp8_kv_cache or self.kv_cache_dtype != "auto":
            return f"K/V cache dtype {self.kv_cache_dtype}"
        if self.sliding_window != -1:
            return "a sliding window"
        if self.alibi_slopes is not None:
            return "ALiBi"
        if self.logits_soft_cap:
            return "a logit soft cap"
        if self.sinks is not None:
            return "attention sinks"
        if self.num_heads % self.num_kv_heads:
            return f"{self.num_heads} query heads over {self.num_kv_heads} K/V heads"
        return None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.cascade_reason:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        write_kv(kv_cache, key, value, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:
            return output
        if self.cascade_reason:
            stats["fallback_layer_runs"] += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("cascade_vllm: fused output quantization is not supported")
        step = attn_metadata.cascade_step
        if step is None:
            # The layer's cache holds cascade's layout (do_kv_cache_update), which vLLM's kernels cannot read.
            raise NotImplementedError("cascade_vllm: a non-causal or dynamic-causal step on a cascade layer")
        if step.n_rows == 0:
            return output
        plan = self._plan(step, kv_cache.dtype)
        n = step.n_rows
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        plan.run(cache_view(kv_cache, 0), cache_view(kv_cache, 1), q, starts=step.tree.starts, out=out)
        stats["cascade_layer_runs"] += 1
        return output

    def _plan(self, step: CascadeStep, kv_dtype: torch.dtype):
        key = (self.scale, self.num_heads, self.num_kv_heads, self.head_size, kv_dtype)
        plan = step.plans.get(key)
        if plan is None:
            t = step.tree
            plan = cascade.Plan(t.segments, t.paths, t.n_query, n_q_heads=self.num_heads,
                                n_kv_heads=self.num_kv_heads, head_dim=self.head_size, scale=self.scale,
                                method=_method(), kv_dtype=str(kv_dtype).removeprefix("torch."),
                                threads=_threads())
            step.plans[key] = plan
        return plan


class CascadeAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return CascadeAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return CascadeAttentionMetadataBuilder
