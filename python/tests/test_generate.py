"""Model.generate on the real SmolLM2-135M model (fetched by scripts/setup.sh; skipped without it)."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import cascade
from conftest import MODEL

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} is missing (bash scripts/setup.sh fetches it)")


@pytest.fixture(scope="module")
def model():
    return cascade.Model(MODEL)


def test_generate_returns_texts_tokens_and_timings(model):
    assert model.hparams["n_layer"] == 30 and model.hparams["head_dim"] == 64
    prompts = ["The capital of France is", "The capital of France is a city"]
    r = model.generate(prompts, n=3, max_tokens=12, temperature=0.7, seed=5, attn="cascade")
    assert len(r.texts) == len(r.tokens) == len(r.stop) == 6 and r.prompt == [0, 0, 0, 1, 1, 1]
    for text, ids, stop in zip(r.texts, r.tokens, r.stop):
        assert text == model.detokenize(ids)
        assert stop in ("eog", "length") and len(ids) <= 12 and (stop == "eog" or len(ids) == 12)
    assert r.n_prompt_tokens == sum(len(model.tokenize(p)) for p in prompts)
    assert r.n_prompt_stored < r.n_prompt_tokens  # the shared beginning is stored once
    t = r.timings
    assert t["prompt_ms"] > 0 and len(t["step_ms"]) >= 1 and t["decode_ms"] == pytest.approx(sum(t["step_ms"]))
    assert r.seed == 5 and r.cost_model is None
    again = model.generate(prompts, n=3, max_tokens=12, temperature=0.7, seed=5, attn="cascade")
    assert again.tokens == r.tokens  # same seed, same tokens


def test_greedy_repeats_itself_for_every_method(model):
    # With int8 activations two methods' texts may part ways after some tokens (the README says why); each method,
    # and auto with one profile, gives the same greedy text every time.
    def greedy(m, **kw):
        return model.generate("Once upon a time", n=2, max_tokens=8, temperature=0, attn=m, ignore_eos=True, **kw)
    runs = {m: greedy(m) for m in ("cascade", "split", "unified", "auto")}
    for m, r in runs.items():
        assert all(len(t) == 8 for t in r.tokens), m
        if m != "auto":
            assert greedy(m).tokens == r.tokens, m
    assert isinstance(runs["auto"].cost_model, cascade.CostModel)
    r = greedy("auto", cost_model=runs["auto"].cost_model)
    assert r.tokens == runs["auto"].tokens and r.timings["calibrate_ms"] == 0


def test_every_kv_type_generates_and_repeats_itself(model):
    for kv in ("bfloat16", "float32", "f16", "q8_0"):
        def greedy():
            return model.generate("Once upon a time", n=2, max_tokens=8, temperature=0, attn="cascade",
                                  ignore_eos=True, kv_type=kv)
        r = greedy()
        assert all(len(t) == 8 for t in r.tokens), kv
        assert greedy().tokens == r.tokens, kv


def test_auto_profile_kept_in_the_cache(model, tmp_path, monkeypatch):
    # The first auto run calibrates and keeps the profile; the next reads it (no calibration) and generates the
    # same greedy text; recalibrate=True measures anew; a damaged file or a folder that cannot be written is a
    # RuntimeWarning, and the run calibrates for itself.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    def greedy(**kw):
        return model.generate("Once upon a time", n=2, max_tokens=4, temperature=0, ignore_eos=True, **kw)
    first = greedy()
    assert first.profile_source == "calibrated" and first.timings["calibrate_ms"] > 0
    path = pathlib.Path(first.profile_path)
    assert path.parent == tmp_path / "cascade" and path.is_file()
    second = greedy()
    assert second.profile_source == "cache" and second.profile_path == first.profile_path
    assert second.timings["calibrate_ms"] == 0 and str(second.cost_model) == str(first.cost_model)
    assert second.tokens == greedy(cost_model=first.cost_model).tokens
    again = greedy(recalibrate=True)
    assert again.profile_source == "calibrated" and again.timings["calibrate_ms"] > 0 and path.is_file()
    assert greedy(attn="cascade").profile_source is None  # no profile needed
    assert greedy(cost_model=first.cost_model).profile_source == "given"
    path.write_text("not a profile\n")
    with pytest.warns(RuntimeWarning, match="unusable"):
        damaged = greedy()
    assert damaged.profile_source == "calibrated" and greedy().profile_source == "cache"  # written anew
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cascade/ cannot be made inside a file
    with pytest.warns(RuntimeWarning, match="cannot keep the profile"):
        alone = greedy()
    assert alone.profile_source == "calibrated" and alone.profile_path is None
    with pytest.raises(ValueError, match=r"^recalibrate: given with attn='cascade'"):
        greedy(attn="cascade", recalibrate=True)
    with pytest.raises(ValueError, match=r"^recalibrate: given with a cost_model"):
        greedy(cost_model=first.cost_model, recalibrate=True)


def test_chat_and_context_limit(model):
    r = model.generate("Say hello.", n=1, max_tokens=4, temperature=0, chat=True)
    assert len(r.tokens[0]) <= 4
    n_prompt = len(model.tokenize("Hello there"))
    r = model.generate("Hello there", n=2, max_tokens=100, n_ctx=n_prompt + 3, temperature=0, ignore_eos=True)
    assert r.stop == ["context", "context"] and all(len(t) == 3 for t in r.tokens)


def test_gil_is_released_while_generating(model):
    ticks = 0
    done = threading.Event()

    def count():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    try:
        start = ticks
        r = model.generate("Once upon a time", n=2, max_tokens=24, temperature=0, ignore_eos=True, attn="cascade")
        during = ticks - start
    finally:
        done.set()
        t.join()
    elapsed_ms = r.timings["prompt_ms"] + r.timings["decode_ms"]
    # With the GIL held throughout, the counting thread would not run at all during generate().
    assert during >= max(3, elapsed_ms / 1000 / 0.001 * 0.1), (during, elapsed_ms)


def test_ctrl_c_stops_generation_cleanly():
    script = textwrap.dedent(f"""
        import signal, sys, time, cascade
        # Python ignores SIGINT when it starts with SIGINT ignored (a background job): handle it as a terminal would.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        m = cascade.Model({str(MODEL)!r})
        print("ready", flush=True)
        t0 = time.time()
        try:
            m.generate("Once upon a time", n=2, max_tokens=100000, n_ctx=1024, ignore_eos=True, attn="cascade")
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted after {{time.time() - t0:.1f}} s", flush=True)
        r = m.generate("Once upon a time", n=1, max_tokens=3, temperature=0, ignore_eos=True)
        print("still usable", len(r.tokens[0]), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("interrupted after") and lines[1] == "still usable 3", out


def test_ctrl_c_stops_the_prefill():
    # A long prompt and no decode step (max_tokens=0): Ctrl-C must stop it between prefill passes, not when
    # the prefill is over. The full prefill's time is estimated from a short prompt's at the same batch size.
    script = textwrap.dedent(f"""
        import signal, sys, time, cascade
        signal.signal(signal.SIGINT, signal.default_int_handler)
        m = cascade.Model({str(MODEL)!r})
        short, long = "one two three four " * 16, "one two three four " * 1000
        r = m.generate(short, n=1, max_tokens=0, batch_size=4, attn="cascade")
        estimate = r.timings["prompt_ms"] / 1e3 * len(m.tokenize(long)) / len(m.tokenize(short))
        print("ready", estimate, flush=True)
        t0 = time.time()
        try:
            m.generate(long, n=1, max_tokens=0, batch_size=4, n_ctx=8192, attn="cascade")
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted after {{time.time() - t0:.2f}}", flush=True)
        r = m.generate("Once upon a time", n=1, max_tokens=3, temperature=0, ignore_eos=True)
        print("still usable", len(r.tokens[0]), flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    ready = p.stdout.readline().split()
    assert ready[0] == "ready", ready
    estimate = float(ready[1])
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("interrupted after") and lines[1] == "still usable 3", out
    if estimate < 3:
        pytest.skip(f"the prefill would take {estimate:.1f} s here: too short to tell a stop between passes")
    # Stopped between passes: well before the prefill's end (the signal came 0.5 s in).
    assert float(lines[0].split()[-1]) < 0.5 * estimate, (out, estimate)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match=r"^attn: unknown attention method 'fast'"):
        model.generate("x", attn="fast")
    with pytest.raises(ValueError, match=r"^n: sequences per prompt must be >= 1"):
        model.generate("x", n=0)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: the prompt is empty"):
        model.generate(["x", ""])
    with pytest.raises(TypeError, match=r"^prompts: expected a str or a list of str"):
        model.generate([1, 2])
    with pytest.raises(ValueError, match=r"^top-p must be in \[0, 1\]"):
        model.generate("x", top_p=2.0)
    with pytest.raises(ValueError, match=r"^prompt 1 has \d+ tokens, which leaves no room in the context of 3 tokens$"):
        model.generate("one two three four five six", n_ctx=3)
    with pytest.raises(ValueError, match=r"^kv_type: expected"):
        model.generate("x", kv_type="int4")
    with pytest.raises(ValueError, match=r"^cost_model: given with attn='cascade'"):
        model.generate("x", attn="cascade", cost_model=cascade.CostModel.parse("cascade-cost-model 1\n"))
    with pytest.raises(ValueError, match=r"^cost_model: calibrated on float16 K/V, but kv_type is 'q8_0'"):
        model.generate("x", kv_type="q8_0", cost_model=cascade.CostModel.parse("cascade-cost-model 1\nkv_type f16\n"))
    with pytest.raises(ValueError, match=r"cannot open|No such file|cannot read"):
        cascade.Model("/nonexistent/model.gguf")
