"""cascade: prefix-aware ("cascade") attention on NumPy arrays and PyTorch CPU tensors, and generation.

Kernels (plan once per step, run once per layer):

    plan = cascade.Plan.two_level(1000, [50] * 4, n_q_heads=8, n_kv_heads=2, head_dim=64)
    o, lse = plan.run(k, v, q)      # k, v: one (tokens, n_kv_heads, head_dim) array per segment
    layer = plan.bind(k, v)         # or bind a layer's K/V once (checked and converted once) ...
    o, lse = layer.run(q)           # ... and run it with each q: a call costs the same for any segment count

- ``Plan(segments, paths, n_query, ...)``: any tree of K/V segments; ``Plan.two_level`` and
  ``Plan.independent`` for the common shapes; ``method='auto'`` lets a cost model (``CostModel``) choose,
  per segment, between one shared pass and folding it into its sequences.
- ``Plan.bind(k, v)`` -> ``BoundPlan``: the plan and one layer's K/V, held (kept alive) and read in place on
  every ``run(q)``; for many segments it saves the per-array conversion Plan.run pays on every call.
- ``Q8_0(codes, scales)``: q8_0 K or V (int8 codes, one float16 scale per 32 of a head's row) in place of an
  array; ``quantize_q8_0(x)`` makes one with the library's quantizer, ``Plan(..., kv_dtype='q8_0')`` prices them.
- ``SplitLayout`` and ``UnifiedLayout``: the two baselines (K/V copied per sequence; one buffer with a mask).
- ``merge_state``, ``merge_state_in_place``, ``merge_states``: the exact merge of attention states
  ``(o, lse)``, lse in natural log, the empty state ``(0, -inf)``.

Arrays are read in place when their layout allows; results come back in the caller's framework (PyTorch for
torch tensors, else NumPy). Computation is float32; the GIL is released while it runs. A wrong dtype raises
TypeError, a wrong shape, device or layout ValueError, both naming the argument; the library's own errors
are ValueError with its message.

Generation: ``Model(path).generate(prompts, n=4, max_tokens=64, ...)`` on a Llama-style GGUF model.
"""

from ._cascade import (
    BoundPlan,
    CostModel,
    Plan,
    Q8_0,
    SplitLayout,
    UnifiedLayout,
    __version__,
    merge_state,
    merge_state_in_place,
    merge_states,
    quantize_q8_0,
)
from ._model import Generation, Model

# The public names; nothing else of what the package imports (os, typing, ...) is part of its namespace.
__all__ = [
    "BoundPlan",
    "CostModel",
    "Plan",
    "Q8_0",
    "quantize_q8_0",
    "SplitLayout",
    "UnifiedLayout",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "Model",
    "Generation",
    "__version__",
]
