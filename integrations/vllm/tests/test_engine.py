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
# A near-tie: where the two engines pick different tokens, vLLM's own top two were this close (natural log).
TIE = 0.1
# Logprobs of the same token at the same step, both engines in bf16 (attention summed in another order).
LOGPROB_TOL = 0.15

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


def run_engine(tmp_path: Path, name: str, prompts: list[str], plugin: bool) -> dict:
    src = tmp_path / f"{name}-prompts.json"
    out = tmp_path / f"{name}.json"
    src.write_text(json.dumps(prompts))
    env = dict(os.environ)
    env["VLLM_PLUGINS"] = "cascade" if plugin else ""
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("run_llm.py")), str(MODEL), str(src),
                        str(out), "--max-tokens", str(MAX_TOKENS)], env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text()) | {"log": r.stderr}


def compare(base: dict, mine: dict) -> list[str]:
    """Token-for-token equality up to near-ties, and the chosen tokens' logprobs until the first divergence."""
    problems = []
    for i, (b, m) in enumerate(zip(base["results"], mine["results"])):
        for step, (tb, tm) in enumerate(zip(b["tokens"], m["tokens"])):
            lb, lm = b["logprobs"][step], m["logprobs"][step]
            if str(tb) in lm and abs(lb[str(tb)] - lm[str(tb)]) > LOGPROB_TOL:
                problems.append(f"prompt {i} step {step}: token {tb} logprob {lb[str(tb)]:.4f} vs {lm[str(tb)]:.4f}")
            if tb != tm:
                top = sorted(lb.values(), reverse=True)
                gap = top[0] - lb.get(str(tm), min(top))
                if gap > TIE:
                    problems.append(f"prompt {i} step {step}: token {tm} instead of {tb}, not a near-tie "
                                    f"(gap {gap:.4f})")
                break  # past a divergence the two continue different texts
    return problems


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"no model at {MODEL} (scripts/vllm-setup.sh writes build/vllm-model)")
    tmp = tmp_path_factory.mktemp("engine")
    prompts = [SYSTEM + q for q in QUESTIONS] + OTHERS
    return run_engine(tmp, "own", prompts, False), run_engine(tmp, "cascade", prompts, True)


def test_backends(runs):
    base, mine = runs
    assert base["backend"].endswith("cpu_attn.CPUAttentionBackend")
    assert mine["backend"] == "cascade_vllm.backend.CascadeAttentionBackend"


def test_greedy_outputs_match_vllm_own_backend(runs):
    base, mine = runs
    assert len(base["results"]) == len(mine["results"]) == len(QUESTIONS) + len(OTHERS)
    assert all(len(r["tokens"]) == MAX_TOKENS for r in mine["results"])
    assert compare(base, mine) == []


def test_cascade_path_ran_with_shared_spans(runs):
    _, mine = runs
    stats = mine["stats"]
    assert stats is not None
    assert stats["fallback_layer_runs"] == 0
    assert stats["cascade_layer_runs"] >= stats["steps"] * 30  # SmolLM2's 30 layers every step
    assert stats["shared_steps"] > 0  # the four requests read the system prompt's blocks as one segment
    assert stats["max_shared"] >= 1
