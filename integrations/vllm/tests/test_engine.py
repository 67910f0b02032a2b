"""vLLM's offline engine with the plugin against vLLM's own CPU backend, on the same model and prompts.

Needs the model vLLM loads: CASCADE_VLLM_MODEL, or build/vllm-model (scripts/vllm-setup.sh writes it); skips
without one. Each engine runs in its own process (run_llm.py): VLLM_PLUGINS="" keeps the plugin out of one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODEL = Path(os.environ.get("CASCADE_VLLM_MODEL", ROOT / "build" / "vllm-model"))
MAX_TOKENS = 24
# Tokens per step: the four long prompts go in chunks, while the short ones already decode.
MAX_BATCHED_TOKENS = 256
# Per model dtype: (near-tie, logprob tolerance), natural log. A near-tie: where the engines pick different tokens,
# vLLM's own logprobs of the two were this close. The logprob of the same token at the same step may differ by the
# tolerance: cascade computes in float32 whatever the cache type, vLLM's bf16 kernels round products and
# probabilities to bf16 (in float32 both agree to 2e-5).
TOLERANCES = {"float32": (0.01, 1e-3), "bfloat16": (0.1, 0.3)}

SYSTEM = ("You are a careful assistant for a public library. You answer questions about opening hours, "
          "borrowing rules, the catalogue, events and the reading rooms. The library opens at nine in the "
          "morning and closes at eight in the evening on weekdays, and at five on Saturdays; it is closed on "
          "Sundays and public holidays. Members may borrow up to twelve items at once for three weeks, and may "
          "renew each item twice unless another member has reserved it. Late returns cost twenty cents a day "
          "per item, up to five euros. The reading rooms are quiet spaces; phones must be silent there. "
          "Children's events take place on Wednesday afternoons and Saturday mornings. The catalogue can be "
          "searched online or at the terminals near the entrance. Answer briefly and politely, and if you do "
          "not know something, say so and suggest asking at the front desk. ") * 2
QUESTIONS = ["When does the library open on Saturday?", "How many books can I borrow?",
             "What happens if I return a book late?", "Are there events for children?"]
OTHERS = ["The capital of France is", "def fibonacci(n):\n    "]


def start_engine(tmp_path: Path, name: str, prompts: list[str], plugin: bool, dtype: str, *extra: str,
                 env_extra: dict | None = None):
    src = tmp_path / f"{name}-prompts.json"
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    src.write_text(json.dumps(prompts))
    env = dict(os.environ)
    env["VLLM_PLUGINS"] = "cascade" if plugin else ""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(env_extra or {})
    cmd = [sys.executable, str(Path(__file__).with_name("run_llm.py")), str(MODEL), str(src), str(out),
           "--max-tokens", str(MAX_TOKENS), "--dtype", dtype, "--max-batched-tokens", str(MAX_BATCHED_TOKENS),
           *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w")), out, log


def finish_engine(started) -> dict:
    proc, out, log = started
    rc = proc.wait(timeout=1500)
    assert rc == 0, log.read_text()[-4000:]
    return json.loads(out.read_text()) | {"log": log.read_text()}


def compare(base: dict, mine: dict, tie: float, logprob_tol: float) -> list[str]:
    """Token-for-token equality up to near-ties, and the chosen tokens' logprobs until the first divergence."""
    problems = []
    for i, (b, m) in enumerate(zip(base["results"], mine["results"])):
        for step, (tb, tm) in enumerate(zip(b["tokens"], m["tokens"])):
            lb, lm = b["logprobs"][step], m["logprobs"][step]
            if str(tb) in lm and abs(lb[str(tb)] - lm[str(tb)]) > logprob_tol:
                problems.append(f"prompt {i} step {step}: token {tb} logprob {lb[str(tb)]:.4f} vs {lm[str(tb)]:.4f}")
            if tb != tm:
                top = sorted(lb.values(), reverse=True)
                gap = top[0] - lb.get(str(tm), min(top))
                if gap > tie:
                    problems.append(f"prompt {i} step {step}: token {tm} instead of {tb}, not a near-tie "
                                    f"(gap {gap:.4f})")
                break  # past a divergence the two continue different texts
    return problems


@pytest.fixture(scope="module", params=list(TOLERANCES))
def runs(request, tmp_path_factory):
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no model at {MODEL} (scripts/vllm-setup.sh writes build/vllm-model)")
    tmp = tmp_path_factory.mktemp("engine")
    prompts = [SYSTEM + q for q in QUESTIONS] + OTHERS
    dtype = request.param
    own = start_engine(tmp, "own", prompts, False, dtype)  # both at once: most of each run is start-up
    mine = start_engine(tmp, "cascade", prompts, True, dtype)
    return finish_engine(own), finish_engine(mine), TOLERANCES[dtype]


def test_backends(runs):
    base, mine, _ = runs
    assert base["backend"].endswith("cpu_attn.CPUAttentionBackend")
    assert mine["backend"] == "cascade_vllm.backend.CascadeAttentionBackend"


def test_greedy_outputs_match_vllm_own_backend(runs):
    base, mine, (tie, logprob_tol) = runs
    assert len(base["results"]) == len(mine["results"]) == len(QUESTIONS) + len(OTHERS)
    assert all(len(r["tokens"]) == MAX_TOKENS for r in mine["results"])
    assert compare(base, mine, tie, logprob_tol) == []


def test_cascade_path_ran_with_shared_spans(runs):
    _, mine, _ = runs
    stats = mine["stats"]
    assert stats is not None
    assert stats["fallback_layer_runs"] == 0
    assert stats["cascade_layer_runs"] >= stats["steps"] * 30  # SmolLM2's 30 layers every step
    assert stats["shared_steps"] > 0  # the four requests read the system prompt's blocks as one segment
    assert stats["max_shared"] >= 2  # the system prompt fills two 128-token blocks
    assert stats["chunked_prefill_steps"] > 0  # prompt chunks after tokens already in the cache
    assert stats["mixed_steps"] > 0  # prompt chunks and decodes in one plan


def test_tensor_parallel_workers_each_run_cascade(tmp_path):
    """vLLM's multiprocess executor with three workers, tensor parallel: each in a process of its own with 3 of
    SmolLM2's 9 query heads and 1 of its 3 K/V heads in every layer. The plugin plans every step in each of them,
    and the tokens are those of vLLM's own backend in one process. (Two workers cannot split 3 K/V heads; pipeline
    parallel fails in vLLM 0.32's CPU build with either backend: its second stage finds no intermediate tensors.)"""
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no model at {MODEL} (scripts/vllm-setup.sh writes build/vllm-model)")
    prompts = [SYSTEM + q for q in QUESTIONS] + OTHERS
    stats_dir = tmp_path / "stats"
    stats_dir.mkdir()
    # Cores for the workers' OpenMP threads, none reserved: vLLM's automatic binding reserves a core per worker
    # for its front end, which leaves none on a 2-core machine.
    n_cpus = os.cpu_count() or 1
    bind = "|".join(str(w % n_cpus) for w in range(3))
    tp_env = {"CASCADE_VLLM_STATS_DIR": str(stats_dir), "VLLM_CPU_OMP_THREADS_BIND": bind,
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    own = start_engine(tmp_path, "own", prompts, False, "float32")
    mine = start_engine(tmp_path, "cascade-tp3", prompts, True, "float32", "--tensor-parallel", "3",
                        env_extra=tp_env)
    base, mine = finish_engine(own), finish_engine(mine)
    tie, logprob_tol = TOLERANCES["float32"]
    assert compare(base, mine, tie, logprob_tol) == []
    workers = [json.loads(p.read_text()) for p in stats_dir.glob("*.json")]
    assert len(workers) == 3, [p.name for p in stats_dir.iterdir()]
    for w in workers:
        assert w["fallback_layer_runs"] == 0
        assert w["cascade_layer_runs"] >= (w["steps"] - 1) * 30  # every layer of every step but the last
        assert w["shared_steps"] > 0
