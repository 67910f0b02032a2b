#!/usr/bin/env python3
"""cascade-server over HTTP on 127.0.0.1, one case per run (ctest runs each as a test):

    server_http_test.py SERVER MODEL CASE

Cases: openai (the official client: completions and chat, streamed and not, n > 1, the usage chunk only when
stream_options asks for it), bad_input (raw HTTP: every bad-input row gets its status and an OpenAI error object with
a code, and nothing else changes), auth, overload, shared_prompt (16 concurrent clients sharing a 1,000-token system
prompt), disconnect, shutdown, exhaustion (idle connections, bodies at and over --max-body, more streams than -np;
threads, open files and memory stay bounded), logprobs (completions and chat, whole and streamed), penalties
(presence, frequency, repetition, logit_bias), max_tokens (--max-tokens and the defaults), client_leaves (a request
answered whole whose client leaves is cancelled, and does not hold up SIGTERM). Each case starts its own server on an
ephemeral port; every wait is bounded in count and time.
"""
import gzip
import http.client
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

SERVER, MODEL, CASE = sys.argv[1], sys.argv[2], sys.argv[3]
TOKENIZE = os.path.join(os.path.dirname(SERVER), "cascade-tokenize")  # built beside the server
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # seconds any one request or wait may take on a loaded 2-core machine
_cache = tempfile.TemporaryDirectory(prefix="cascade-server-test-")
CACHE_DIR = _cache.name  # XDG_CACHE_HOME of every server a case starts


def fail(msg):
    raise AssertionError(msg)


def check(cond, msg):
    if not cond:
        fail(msg)


class Server:
    """cascade-server started on an ephemeral port; stderr is collected by a thread."""

    def __init__(self, *args):
        # auto's profile goes to a cache folder of this run's own, never the user's ~/.cache/cascade
        env = dict(os.environ, XDG_CACHE_HOME=CACHE_DIR)
        self.proc = subprocess.Popen([SERVER, "-m", MODEL, "--port", "0", *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self.port = None
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        check(ready.wait(TIMEOUT) and self.port, "the server did not start:\n" + "".join(self.lines))
        self.base = f"http://127.0.0.1:{self.port}"

    def request(self, method, path, body=None, headers=None):
        """Raw HTTP: (status, headers, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), data

    def metrics(self, headers=None):
        status, _, body = self.request("GET", "/metrics", headers=headers)
        check(status == 200, f"/metrics answered {status}")
        out = {}
        for line in body.decode().splitlines():
            if line.startswith("#"):
                continue
            m = re.fullmatch(r"([a-z_]+(?:\{[^}]*\})?) (\S+)", line)
            check(m, f"not a Prometheus sample line: {line!r}")
            out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, what="the server to be idle"):
        deadline = time.time() + TIMEOUT
        while time.time() < deadline:
            m = self.metrics()
            if m["cascade_active_requests"] == 0 and m["cascade_queue_depth"] == 0:
                return m
            time.sleep(0.05)
        fail(f"timed out waiting for {what}")

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the server did not stop within the timeout")


def stream_request(port, path, body):
    """Starts a streamed request on a raw socket; returns the socket and a reader of its SSE data lines."""
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    data = json.dumps(body).encode()
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
              .encode() + data)
    f = s.makefile("rb")
    status = f.readline().decode()
    check(" 200 " in status, f"stream answered {status!r}")
    while f.readline() not in (b"\r\n", b""):  # headers
        pass
    return s, f


def read_events(f, n):
    """Reads up to n SSE data lines (chunked transfer: size lines, payloads, blank lines)."""
    events = []
    while len(events) < n:
        line = f.readline()
        if not line:
            break
        line = line.strip()
        if line.startswith(b"data: "):
            events.append(line[6:].decode())
    return events


def system_prompt(n_chars):
    with open(os.path.join(REPO, "bench", "prompt-1230.txt")) as f:
        return f.read()[:n_chars]


# --- cases ------------------------------------------------------------------------------------------------


def case_openai():
    import openai

    srv = Server("-np", "8")
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        models = client.models.list()
        model = models.data[0].id
        check(model == "SmolLM2-135M-Instruct.Q4_1", f"model id {model!r}")

        prompt = "The three primary colors are"
        one = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        check(len(one.choices) == 1 and one.choices[0].text, f"empty completion: {one}")
        check(one.choices[0].finish_reason in ("stop", "length"), f"finish_reason {one.choices[0].finish_reason}")
        check(one.usage.prompt_tokens == 5 and one.usage.completion_tokens <= 12, f"usage {one.usage}")
        check(one.usage.total_tokens == one.usage.prompt_tokens + one.usage.completion_tokens, "total_tokens")

        # n > 1 with a seed: the same choices streamed and not.
        many = client.completions.create(model=model, prompt=prompt, max_tokens=10, n=3, seed=11, temperature=0.9)
        check(sorted(c.index for c in many.choices) == [0, 1, 2], "choice indices")
        check(0 < many.usage.completion_tokens <= 30, f"usage {many.usage}")
        check(many.usage.prompt_tokens_details.cached_tokens == 4, f"cached {many.usage.prompt_tokens_details}")
        texts = {}
        usage = None
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=10, n=3, seed=11,
                                               temperature=0.9, stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            if chunk.usage:
                usage = chunk.usage
        check(texts == {c.index: c.text for c in many.choices}, f"streamed {texts} vs {many.choices}")
        check(usage is not None and usage.completion_tokens == many.usage.completion_tokens, f"stream usage {usage}")
        check(len(set(texts.values())) > 1, "three sampled choices should not all agree")

        # Token ids as the prompt.
        ids = client.completions.create(model=model, prompt=[504, 1314, 3328, 4987], max_tokens=4, temperature=0)
        check(ids.usage.prompt_tokens == 4, f"token-id prompt usage {ids.usage}")

        # Chat, streamed and not, n = 2.
        msgs = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, n=2, temperature=0)
        check(len(chat.choices) == 2, "two chat choices")
        check(chat.choices[0].message.role == "assistant" and chat.choices[0].message.content, f"chat {chat}")
        check(chat.choices[0].message.content == chat.choices[1].message.content, "greedy choices agree")
        check("Paris" in chat.choices[0].message.content, f"the model knows: {chat.choices[0].message.content!r}")
        parts, roles, finish, usage = {}, set(), {}, None
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=16, n=2, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            for c in chunk.choices:
                if c.delta.role:
                    roles.add(c.delta.role)
                parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
            if chunk.usage:
                usage = chunk.usage
        check(parts == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}, f"chat stream {parts}")
        check(roles == {"assistant"} and set(finish) == {0, 1}, f"roles {roles}, finish {finish}")
        check(usage.prompt_tokens == chat.usage.prompt_tokens, "chat stream usage")
        check(usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens - 1, "the same chat is cached")
        # Without stream_options, as OpenAI: no usage chunk, so the common loop over chunk.choices[0] works.
        text, n_chunks = "", 0
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0,
                                                    stream=True):
            check(chunk.usage is None, f"a usage chunk nobody asked for: {chunk}")
            text += chunk.choices[0].delta.content or ""
            n_chunks += 1
        check(text == chat.choices[0].message.content and n_chunks > 2, f"plain chat stream {text!r}")

        # Stop strings.
        full = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
        cut = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                        stop=[" 6"])
        check(" 6" in full.choices[0].text, f"the uncut text {full.choices[0].text!r} has the stop string")
        check(cut.choices[0].text == full.choices[0].text.split(" 6")[0] and cut.choices[0].finish_reason == "stop",
              f"stopped text {cut.choices[0].text!r}")

        # Errors come back as the client's exceptions; an unknown model is 404, as OpenAI answers it.
        try:
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
            fail("an unknown model was accepted")
        except openai.NotFoundError as e:
            check(e.body["code"] == "model_not_found" and e.body["param"] == "model", f"error body {e.body}")
            check("--alias" in e.body["message"], f"the message names --alias: {e.body}")
    finally:
        check(srv.stop() == 0, "exit code")
    # --attn auto (the default) calibrated its profile at the first start and keeps it: the next start reads it.
    first = next(line for line in srv.lines if "listening on" in line)
    check("auto's profile calibrated in" in first, f"first start: {first!r}")
    again = Server("-np", "8")
    try:
        line = next(line for line in again.lines if "listening on" in line)
        check("auto's profile from the cache" in line, f"second start: {line!r}")
    finally:
        check(again.stop() == 0, "exit code")


def case_bad_input():
    srv = Server("-np", "2", "-c", "256", "--attn", "cascade")
    try:
        before = srv.metrics()
        long_prompt = "word " * 400
        C, CH = "/v1/completions", "/v1/chat/completions"
        rows = [
            # (path, body, status, param or None)
            (C, b'{"prompt": "x"', 400, None),
            (C, b"", 400, None),
            (C, b"[1, 2]", 400, None),
            (C, b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8
            (C, {}, 400, "prompt"),
            (C, {"prompt": 5}, 400, "prompt"),
            (C, {"prompt": None}, 400, "prompt"),
            (C, {"prompt": ""}, 400, "prompt"),
            (C, {"prompt": []}, 400, "prompt"),
            (C, {"prompt": ["a", "b"]}, 400, "prompt"),
            (C, {"prompt": [1, 99999999]}, 400, "prompt"),
            (C, {"prompt": [1, -3]}, 400, "prompt"),
            (C, {"prompt": [1, 2.5]}, 400, "prompt"),
            (C, {"prompt": "x", "n": 0}, 400, "n"),
            (C, {"prompt": "x", "n": "2"}, 400, "n"),
            (C, {"prompt": "x", "n": 1.5}, 400, "n"),
            (C, {"prompt": "x", "n": 129}, 400, "n"),
            (C, {"prompt": "x", "n": 3}, 400, "n"),  # more than -np
            (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
            (C, {"prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
            (C, {"prompt": "x", "max_tokens": 10 ** 30}, 400, "max_tokens"),
            (C, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
            (C, {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
            (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
            (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
            (C, {"prompt": "x", "top_k": -1}, 400, "top_k"),
            (C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
            (C, {"prompt": "x", "seed": "x"}, 400, "seed"),
            (C, {"prompt": "x", "stop": 5}, 400, "stop"),
            (C, {"prompt": "x", "stop": ["a", 3]}, 400, "stop"),
            (C, {"prompt": "x", "stop": [""]}, 400, "stop"),
            (C, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
            (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
            (C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
            (C, {"prompt": "x", "model": 7}, 400, "model"),
            (C, {"prompt": long_prompt}, 400, "prompt"),
            (C, {"prompt": "x", "max_tokens": 256}, 400, "max_tokens"),  # the prompt and its output overflow -c 256
            (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
            (C, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
            (C, {"prompt": "x", "presence_penalty": -3}, 400, "presence_penalty"),
            (C, {"prompt": "x", "frequency_penalty": [1]}, 400, "frequency_penalty"),
            (C, {"prompt": "x", "repetition_penalty": -1}, 400, "repetition_penalty"),
            (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
            (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
            (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
            (C, {"prompt": "x", "echo": True}, 400, "echo"),
            (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
            (CH, {}, 400, "messages"),
            (CH, {"messages": []}, 400, "messages"),
            (CH, {"messages": "hi"}, 400, "messages"),
            (CH, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
            (CH, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
            (CH, {"messages": [{"role": "user"}]}, 400, "messages"),
            (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400,
             "messages"),
            (CH, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
            (CH, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, 400,
             "max_completion_tokens"),
            (CH, {"messages": [{"role": "user", "content": long_prompt}]}, 400, "messages"),
            (CH, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
        ]
        for path, body, want, param in rows:
            status, headers, data = srv.request("POST", path, body, {"Content-Type": "application/json"})
            check(status == want, f"{path} {body!r:.80}: status {status}, expected {want}: {data[:200]!r}")
            err = json.loads(data)["error"]
            check(isinstance(err["message"], str) and err["message"] and err["type"] == "invalid_request_error",
                  f"{body!r:.80}: error object {err}")
            check(isinstance(err["code"], str) and err["code"], f"{body!r:.80}: no code in {err}")
            if param:
                check(err["param"] == param, f"{body!r:.80}: param {err['param']!r}, expected {param!r}")
        status, _, data = srv.request("POST", C, {"prompt": long_prompt})
        check(json.loads(data)["error"]["code"] == "context_length_exceeded", "context error code")
        # Routing, methods, and the body limit.
        for method, path, want in [("GET", "/nowhere", 404), ("GET", C, 405), ("POST", "/v1/models", 405),
                                   ("DELETE", CH, 405), ("GET", "/v1/models/other", 404)]:
            status, _, data = srv.request(method, path)
            check(status == want and json.loads(data)["error"]["code"], f"{method} {path}: {status} {data[:100]!r}")
        status, _, data = srv.request("POST", C, b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
        check(status == 413 and json.loads(data)["error"]["code"] == "request_too_large",
              f"oversized body: {status} {data[:100]!r}")
        # Nothing changed: no request queued, no K/V stored; a good request still works.
        after = srv.metrics()
        for k in ["cascade_requests_total", "cascade_kv_bytes", "cascade_prompt_tokens_total",
                  "cascade_active_requests", "cascade_queue_depth"]:
            check(after[k] == before[k], f"{k} changed from {before[k]} to {after[k]}")
        check(after['cascade_http_responses_total{code="400"}'] == sum(r[2] == 400 for r in rows) + 1, "400s counted")
        status, _, data = srv.request("POST", C, {"prompt": "Hello", "max_tokens": 3})
        check(status == 200 and json.loads(data)["usage"]["completion_tokens"] <= 3, f"good request: {data!r}")
    finally:
        check(srv.stop() == 0, "exit code")


def case_auth():
    import openai

    srv = Server("-np", "2", "--attn", "cascade", "--api-key", "sesame")
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in [{}, {"Authorization": "Bearer open"}, {"Authorization": "sesame"},
                        {"Authorization": "Bearer sesame2"}, {"Authorization": "Bearer sesam"}]:
            for method, path, b in [("POST", "/v1/completions", body), ("GET", "/v1/models", None),
                                    ("GET", "/metrics", None)]:
                status, _, data = srv.request(method, path, b, headers)
                check(status == 401, f"{path} with {headers}: {status}")
                err = json.loads(data)["error"]
                check(err["type"] == "authentication_error" and err["code"] == "invalid_api_key", f"{data!r}")
        status, _, _ = srv.request("GET", "/health")
        check(status == 200, "/health needs no key")
        status, _, _ = srv.request("POST", "/v1/completions", body, {"Authorization": "Bearer sesame"})
        check(status == 200, "the right key")
        good = openai.OpenAI(base_url=srv.base + "/v1", api_key="sesame", timeout=TIMEOUT, max_retries=0)
        check(good.completions.create(model=good.models.list().data[0].id, prompt="Hi", max_tokens=2).choices,
              "client with the key")
        bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="nope", timeout=TIMEOUT, max_retries=0)
        try:
            bad.models.list()
            fail("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
    finally:
        check(srv.stop() == 0, "exit code")


def case_overload():
    srv = Server("-np", "1", "--queue", "1", "--attn", "cascade")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        running, rf = stream_request(srv.port, "/v1/completions", body)
        read_events(rf, 2)
        queued, _ = stream_request(srv.port, "/v1/completions", body)  # waits: the one slot is taken
        deadline = time.time() + TIMEOUT
        while srv.metrics()["cascade_queue_depth"] < 1:
            check(time.time() < deadline, "the second request never queued")
            time.sleep(0.02)
        status, headers, data = srv.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        check(status == 503, f"a full queue answered {status}")
        check(headers.get("Retry-After", "").isdigit(), f"Retry-After missing: {headers}")
        err = json.loads(data)["error"]
        check(err["message"] and err["code"] == "queue_full", f"error object {err}")
        check(srv.metrics()["cascade_requests_refused_total"] == 1, "refusal counted")
        for sock in (running, queued):
            sock.shutdown(socket.SHUT_RDWR)  # close() alone keeps the socket open while its makefile() lives
            sock.close()
        srv.wait_idle("the cancelled requests to leave")
    finally:
        check(srv.stop() == 0, "exit code")


def case_shared_prompt():
    import openai

    srv = Server("-np", "16", "-b", "512")
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        system = system_prompt(5400)
        questions = [f"In one sentence: who is person number {i} in the story, and what do they do?" for i in range(16)]
        results, errors = [None] * 16, []

        def ask(i):
            try:
                results[i] = client.chat.completions.create(
                    model=model, max_tokens=8, temperature=0,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": questions[i]}])
            except Exception as e:  # reported below
                errors.append(f"client {i}: {e!r}")

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        check(not errors and all(r is not None for r in results), f"unanswered: {errors}")
        prompt_tokens = [r.usage.prompt_tokens for r in results]
        check(min(prompt_tokens) >= 1000, f"the system prompt is {min(prompt_tokens)} tokens")
        for r in results:
            check(r.choices[0].message.content, "an empty answer")
        m = srv.metrics()
        cached = m["cascade_prompt_tokens_cached_total"]
        # The chat template's system turn is shared by all 16; 15 of them find it in the cache.
        shared = min(prompt_tokens) - 40
        check(cached >= 15 * shared, f"{cached} prompt tokens served from the cache, expected >= 15 x {shared}")
        check(sum(r.usage.prompt_tokens_details.cached_tokens for r in results) == cached, "usage agrees with /metrics")
        check(m["cascade_prompt_tokens_prefilled_total"] < sum(prompt_tokens) - 15 * shared, "shared tokens computed once")
    finally:
        check(srv.stop() == 0, "exit code")


def case_disconnect():
    srv = Server("-np", "4", "--attn", "cascade")
    try:
        prompt = system_prompt(600)
        status, _, _ = srv.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        check(status == 200, "warm-up")
        idle = srv.wait_idle()
        baseline, held = idle["cascade_kv_bytes"], idle["cascade_kv_allocated_bytes"]
        check(held == baseline, f"the cached prompt holds {held} bytes for {baseline} stored")
        socks = []
        for n in (1, 3):  # a one-choice request and a forked one
            s, f = stream_request(srv.port, "/v1/completions",
                                  {"prompt": prompt, "max_tokens": 1000, "n": n, "ignore_eos": True, "stream": True})
            check(len(read_events(f, 4)) == 4, "the stream started")
            socks.append(s)
        check(srv.metrics()["cascade_active_sequences"] == 4, "four sequences run")
        check(srv.metrics()["cascade_kv_bytes"] > baseline, "they hold K/V")
        for s in socks:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        m = srv.wait_idle("the server to notice the clients left")
        check(m["cascade_kv_bytes"] == baseline, f"K/V {m['cascade_kv_bytes']} after the disconnects, {baseline} before")
        check(m["cascade_kv_allocated_bytes"] == held, f"K/V memory {m['cascade_kv_allocated_bytes']} after, {held} before")
        check(m["cascade_requests_cancelled_total"] == 2, "two requests cancelled")
        check(m["cascade_kv_reserved_bytes"] == 0, "nothing reserved")
        status, _, _ = srv.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        check(status == 200, "the server still serves")
    finally:
        check(srv.stop() == 0, "exit code")


def case_shutdown():
    srv = Server("-np", "2", "--attn", "cascade", "--shutdown-timeout", "60")
    s, f = stream_request(srv.port, "/v1/completions",
                          {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True,
                           "stream_options": {"include_usage": True}})
    read_events(f, 2)
    srv.proc.send_signal(signal.SIGTERM)
    # New work is refused while the running stream finishes.
    deadline = time.time() + TIMEOUT
    while not any("SIGTERM" in line for line in srv.lines):
        check(time.time() < deadline, "no shutdown line")
        time.sleep(0.02)
    try:
        status, headers, data = srv.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        check(status == 503 and "Retry-After" in headers, f"a request while stopping got {status}")
        check(json.loads(data)["error"]["code"] == "server_shutting_down", f"the 503's body: {data!r}")
    except (ConnectionError, OSError):
        pass  # or the listener is closed already
    events = read_events(f, 100)
    check(events and events[-1] == "[DONE]", f"the running stream ended with {events[-2:]}")
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e).get("choices", []))
    usage = json.loads(events[-2])["usage"]
    check(usage["completion_tokens"] == 40 and text, f"the stream finished: {usage}")
    check(srv.proc.wait(TIMEOUT) == 0, "exit code after SIGTERM")
    check(any("every request finished" in line for line in srv.lines), "".join(srv.lines))


def proc_stats(pid):
    """The server's threads, open file descriptors and resident memory (MiB)."""
    stats = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                stats[key] = int(value.split()[0])
    return {"threads": stats["Threads"], "fds": len(os.listdir(f"/proc/{pid}/fd")), "rss_mib": stats["VmRSS"] / 1024}


def case_exhaustion():
    # A small pool and small limits, so that every bound is reached within a few seconds.
    n_threads, idle_s, max_body = 16, 1, 65536
    srv = Server("-np", "2", "--queue", "2", "--attn", "cascade", "-t", "2", "--http-threads", str(n_threads),
                 "--idle-timeout", str(idle_s), "--read-timeout", "2", "--request-timeout", "3",
                 "--max-body", str(max_body))
    C = "/v1/completions"
    hello = {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}
    try:
        status, _, data = srv.request("POST", C, hello)  # the first request's allocations are made
        check(status == 200, f"a first request: {status} {data[:200]!r}")
        time.sleep(0.5)  # the first request's connection is closed on the server's side too
        base = proc_stats(srv.proc.pid)
        print(f"exhaustion: at rest {base}")
        worst = dict(base)

        def sample():
            for k, v in proc_stats(srv.proc.pid).items():
                worst[k] = max(worst[k], v)

        # 1. Idle connections: 200 that never send a byte, opened as fast as they connect. The server takes one per
        #    thread and 64 more into its backlog; then the listener waits and the kernel's listen queue (64) fills,
        #    after which new handshakes are dropped or answered with SYN cookies the full queue then drops: those
        #    clients hold nothing of the server. While connections wait for a thread, an idle one keeps its thread
        #    for 0.1 s only (not --idle-timeout), so another client is served after about (connections ahead of it /
        #    threads) x 0.1 s: ~0.5 s here, where --idle-timeout would make it ~5 s.
        #    A connect that waits a second counts as dropped (a dropped handshake is retried after one).
        n_idle, dropped = 200, 0
        idle = []
        t0 = time.time()
        for _ in range(n_idle):
            s = socket.socket()
            s.settimeout(1.0)
            try:
                s.connect(("127.0.0.1", srv.port))
                idle.append(s)
            except OSError:  # dropped: the queues are full
                s.close()
                dropped += 1
                if dropped == 3:
                    break
            sample()
        opened = time.time() - t0
        # The server holds a connection from its accept() to its close; what it holds at a moment depends on how
        # much of the cores its listener got (little under a sanitizer on 2 busy cores). It holds one per thread
        # and some of its backlog at some moment: watched for a second more while it drains the kernel's queue.
        held = base["fds"] + n_threads + 16
        deadline = time.time() + 1.0
        while worst["fds"] < held and time.time() < deadline:
            sample()
            time.sleep(0.01)
        check(worst["fds"] >= held,
              f"{len(idle)} idle connections opened in {opened:.2f} s, but the server holds few: {worst}")
        t0 = time.time()
        status, _, data = srv.request("POST", C, hello)
        waited = time.time() - t0
        sample()
        check(status == 200, f"a request beside {len(idle)} idle connections: {status} {data[:200]!r}")
        print(f"exhaustion: a request beside {len(idle)} idle connections (opened in {opened:.1f} s, {dropped} more "
              f"dropped) answered in {waited:.1f} s; worst {worst}")
        # Up to ~2 s on 2 cores kept busy by other work; waits of --idle-timeout would take 5 s or more.
        check(waited < 4.0, f"a request waited {waited:.1f} s behind idle connections")
        for s in idle:
            s.close()

        # 2. Bodies at and over --max-body: at the limit (padded with JSON whitespace) it is served; one byte over,
        #    or far over, or chunked without a length, is 413 with an error object; nothing crashes.
        small = json.dumps(hello).encode()
        at_limit = small[:-1] + b" " * (max_body - len(small)) + b"}"
        check(len(at_limit) == max_body, "padding")
        status, _, data = srv.request("POST", C, at_limit)
        check(status == 200 and json.loads(data)["choices"], f"a body of exactly --max-body: {status} {data[:200]!r}")
        for size in (max_body + 1, 16 * max_body):
            body = small[:-1] + b" " * (size - len(small)) + b"}"
            try:
                status, _, data = srv.request("POST", C, body)
                check(status == 413 and "error" in json.loads(data), f"a body of {size} bytes: {status} {data[:100]!r}")
            except (ConnectionResetError, BrokenPipeError):
                pass  # the server answered 413 and closed while the client was still sending
        # Chunked, and gzip-compressed (1 KiB on the wire, 1 MiB inflated): bounded as they are read, not after.
        piece = b" " * 8192
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(2 * max_body // len(piece)))
        bomb = gzip.compress(small[:-1] + b" " * (1 << 20) + b"}")
        for method, headers, payload, want in [
                ("POST", b"Transfer-Encoding: chunked\r\n", chunked + b"0\r\n\r\n", b"413"),
                ("POST", b"Content-Encoding: gzip\r\nContent-Length: %d\r\n" % len(bomb), bomb, b"413"),
                ("GET", b"Transfer-Encoding: chunked\r\n", chunked + b"0\r\n\r\n", b"400")]:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
            try:
                s.sendall(method.encode() + b" " + C.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" +
                          payload)
            except (ConnectionResetError, BrokenPipeError):
                pass
            reply = b""
            t0 = time.time()
            while chunk := s.recv(4096):  # the server closes the connection after its answer
                reply += chunk
            s.close()
            check(reply.startswith(b"HTTP/1.1 " + want) and b'"error"' in reply,
                  f"{method} {headers!r}: {reply[:300]!r}")
            # One answer, then the end: the body's unread rest is not taken for more requests.
            check(reply.count(b"HTTP/1.1 ") == 1 and time.time() - t0 < 3,
                  f"{method} {headers!r}: {reply.count(b'HTTP/1.1 ')} answers, closed after {time.time() - t0:.1f} s")
        status, _, data = srv.request("POST", C, hello)
        check(status == 200, f"a request after the oversized ones: {status} {data[:200]!r}")
        sample()

        # 3. Slow senders: a byte every 0.3 s never waits out --read-timeout (2 s), but a whole request has
        #    --request-timeout (3 s) from its first byte to arrive. One trickling its headers loses the connection,
        #    one trickling its body gets 408; both long before they would have finished (18 s), and another client is
        #    served meanwhile.
        slow = {}

        def trickle(name, head, rest):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
            t0 = time.time()
            reply = b""
            try:
                s.sendall(head)
                for i in range(len(rest)):
                    if select.select([s], [], [], 0.3)[0]:
                        break  # the server answered or closed
                    s.sendall(rest[i:i + 1])
                while chunk := s.recv(4096):
                    reply += chunk
            except (ConnectionResetError, BrokenPipeError):
                pass
            finally:
                s.close()
            slow[name] = (time.time() - t0, reply)

        body = json.dumps(hello).encode()
        body += b" " * (60 - len(body))
        senders = [threading.Thread(target=trickle, args=(
            "headers", b"POST " + C.encode() + b" HTTP/1.1\r\n", b"Host: x\r\nX-Pad: " + b"a" * 44 + b"\r\n\r\n")),
                   threading.Thread(target=trickle, args=(
            "body", b"POST " + C.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body), body))]
        for t in senders:
            t.start()
        time.sleep(0.5)
        status, _, data = srv.request("POST", C, hello)
        check(status == 200, f"a request beside slow senders: {status} {data[:200]!r}")
        for t in senders:
            t.join()
        sample()
        print("exhaustion: slow senders cut after " +
              ", ".join(f"{k} {v[0]:.1f} s ({v[1][:12]!r})" for k, v in sorted(slow.items())))
        for name, (took, reply) in slow.items():
            check(took < 9, f"a client sending its {name} slowly held its connection for {took:.1f} s")
        check(slow["body"][1].startswith(b"HTTP/1.1 408") and b'"error"' in slow["body"][1],
              f"a body that did not arrive in time: {slow['body'][1][:300]!r}")

        # 4. More streams than -np + --queue at once: each is served to [DONE] or refused with 503 and Retry-After.
        n_streams = 10
        results = [None] * n_streams

        def stream(i):
            body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
                conn.request("POST", C, body=json.dumps(body), headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read().decode()
                results[i] = (r.status, r.getheader("Retry-After"), data)
                conn.close()
            except Exception as e:  # noqa: BLE001 - reported below
                results[i] = (None, None, repr(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n_streams)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            sample()
            time.sleep(0.05)
        served = 0
        for status, retry, data in results:
            if status == 200:
                events = [line[6:] for line in data.splitlines() if line.startswith("data: ")]
                check(events and events[-1] == "[DONE]", f"a stream ended with {events[-2:]}")
                check(json.loads(events[-2])["usage"]["completion_tokens"] == 16, "a stream's usage")
                served += 1
            else:
                check(status == 503 and retry, f"a stream beyond the queue: {status} {data[:200]!r}")
        print(f"exhaustion: {n_streams} streams at once with -np 2 --queue 2: {served} served, "
              f"{n_streams - served} refused with 503")
        check(served >= 2, "fewer streams served than -np")
        srv.wait_idle()
        sample()
        end = proc_stats(srv.proc.pid)
        for _ in range(50):  # the last closed connections' descriptors go once their threads notice
            if end["fds"] <= base["fds"] + 2:
                break
            time.sleep(0.1)
            end = proc_stats(srv.proc.pid)
        print(f"exhaustion: at the end {end}; worst {worst}")
        # Bounded: the pool's threads were all made at start; the descriptors by the threads, the backlog (64) and
        # the listen queue; memory by what the requests needed, not by the connections.
        # (Threads: oneTBB may still start a worker or two on demand. Memory: under AddressSanitizer freed blocks
        # wait in its quarantine, up to 256 MiB.)
        sanitized = b"libasan" in subprocess.run(["ldd", SERVER], capture_output=True).stdout
        check(worst["threads"] <= base["threads"] + 2, f"threads grew from {base['threads']} to {worst['threads']}")
        check(worst["fds"] <= base["fds"] + n_threads + 64 + 16, f"open descriptors grew to {worst['fds']}")
        check(worst["rss_mib"] <= base["rss_mib"] + (64 + 256 if sanitized else 64),
              f"resident memory grew from {base['rss_mib']:.0f} MiB to {worst['rss_mib']:.0f} MiB")
        check(end["fds"] <= base["fds"] + 2, f"descriptors left open: {base['fds']} -> {end['fds']}")
        check(srv.stop() == 0, "exit code")
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def token_id(text):
    """The id of the one token `text` is (cascade-tokenize, no BOS), or None when it is not one token."""
    check(os.path.exists(TOKENIZE), f"{TOKENIZE} is missing (build the cascade-tokenize target)")
    out = subprocess.run([TOKENIZE, "-m", MODEL, "-p", text, "--ids", "--no-bos"], capture_output=True, text=True,
                         timeout=TIMEOUT)
    check(out.returncode == 0, f"cascade-tokenize: {out.stderr}")
    ids = out.stdout.split()
    return int(ids[0]) if len(ids) == 1 else None


def check_completion_logprobs(lp, text, n_top, greedy):
    """A completion choice's logprobs as OpenAI gives them: one entry per token, the tokens spelling the text, each
    token among its alternatives (n_top of them, or n_top + 1 when it is not one), offsets in characters."""
    n = len(lp.tokens)
    check(len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, f"logprobs lengths {lp}")
    check("".join(lp.tokens) == text, f"tokens {lp.tokens} spell {text!r}")
    for k in range(n):
        check(lp.text_offset[k] == len("".join(lp.tokens[:k])), f"text_offset {lp.text_offset}")
        top = lp.top_logprobs[k]
        check(len(top) in (n_top, n_top + 1) and top[lp.tokens[k]] == lp.token_logprobs[k], f"top {k}: {top}")
        check(all(v <= 0 for v in top.values()) and sum(math.exp(v) for v in top.values()) <= 1 + 1e-5,
              f"top {k} is not log-probabilities: {top}")
        if greedy:
            check(lp.token_logprobs[k] == max(top.values()), f"greedy took a token less likely than another: {top}")


def case_logprobs():
    import openai

    srv = Server("-np", "4")
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        prompt = "The history of the printing press begins"
        # Cached first, so that the requests compared below all find it so (a cached prompt's logits may differ
        # from a computed one's in the last bits, and a greedy text with them).
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        one = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=5)
        check(one.usage.completion_tokens == len(one.choices[0].logprobs.tokens), f"{one}")
        check_completion_logprobs(one.choices[0].logprobs, one.choices[0].text, 5, greedy=True)
        # Sampled (n = 2, a seed): the token drawn need not be the likeliest, but is reported with its own.
        two = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=1.2, seed=5, n=2,
                                        logprobs=2)
        for c in two.choices:
            check_completion_logprobs(c.logprobs, c.text, 2, greedy=False)
        # Streamed: the same tokens and numbers.
        tokens, values = [], []
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=5,
                                               stream=True):
            lp = chunk.choices[0].logprobs
            if lp:
                tokens += lp.tokens
                values += lp.token_logprobs
        check(tokens == one.choices[0].logprobs.tokens, f"streamed tokens {tokens}")
        check(values == one.choices[0].logprobs.token_logprobs,
              f"streamed logprobs {values} vs {one.choices[0].logprobs.token_logprobs}")

        # Chat: logprobs=True with top_logprobs; content entries with bytes; streamed the same.
        msgs = [{"role": "user", "content": "Name a color."}]
        client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0)
        chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                              top_logprobs=3)
        content = chat.choices[0].logprobs.content
        check(len(content) == chat.usage.completion_tokens, f"{len(content)} entries")
        check("".join(t.token for t in content) == chat.choices[0].message.content, "chat tokens spell the text")
        for t in content:
            check(bytes(t.bytes).decode("utf-8", "replace") == t.token, f"bytes {t}")
            check(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token, f"top {t.top_logprobs}")
            check(t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob,
                  f"greedy: {t}")
        streamed = []
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=3, stream=True):
            if chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.content
        check([(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content],
              "streamed chat tokens")
        plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        check(plain.choices[0].logprobs is None, "no logprobs unless asked")
        try:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, top_logprobs=2)
            fail("top_logprobs without logprobs was accepted")
        except openai.BadRequestError as e:
            check(e.body["param"] == "top_logprobs", f"{e.body}")
    finally:
        check(srv.stop() == 0, "exit code")


def case_penalties():
    import openai

    srv = Server("-np", "4")
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        prompt = "List of fruits: apple, apple, apple,"
        client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)  # cached, as above
        ask = dict(model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=20,
                   extra_body={"ignore_eos": True})
        plain = client.completions.create(**ask).choices[0]
        # presence and frequency: each step takes the best of logprob - count * frequency - (count > 0) * presence
        # (logprobs are the model's, before the penalties), which the test recomputes over the 20 alternatives.
        presence, frequency = 0.8, 0.6
        pen = client.completions.create(presence_penalty=presence, frequency_penalty=frequency, **ask).choices[0]
        check(pen.text != plain.text, f"the penalties changed nothing: {pen.text!r}")
        counts, moved = {}, 0
        lp = pen.logprobs
        for k, tok in enumerate(lp.tokens):
            def score(t, v):
                c = counts.get(t, 0)
                return v - c * frequency - (presence if c else 0)
            chosen = score(tok, lp.token_logprobs[k])
            for t, v in lp.top_logprobs[k].items():
                check(score(t, v) <= chosen + 1e-4, f"step {k}: {t!r} scores {score(t, v)} > {tok!r} {chosen}")
            moved += lp.token_logprobs[k] < max(lp.top_logprobs[k].values())
            counts[tok] = counts.get(tok, 0) + 1
        check(moved > 0, "the penalties never moved greedy off the likeliest token")
        # repetition_penalty (an extension): accepted, and it changes a repetitive text.
        rep = client.completions.create(extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
                                        **{k: v for k, v in ask.items() if k != "extra_body"}).choices[0]
        check(rep.text != plain.text, f"repetition_penalty changed nothing: {rep.text!r}")
        # logit_bias at the first token: the second likeliest, raised by a little more than the gap, is taken; by a
        # little less, it is not.
        first = sorted(plain.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])
        second = next((t, v) for t, v in first[1:] if token_id(t) is not None)
        gap = first[0][1] - second[1]
        sid = token_id(second[0])
        for extra, wins in ((0.05, True), (-0.05, False)):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                          logit_bias={str(sid): gap + extra})
            check((r.choices[0].text == second[0]) == wins, f"bias {gap + extra}: {r.choices[0].text!r} ({second})")
        banned = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                           logit_bias={str(token_id(first[0][0])): -100})
        check(banned.choices[0].text != first[0][0], "a -100 bias bans the token")
    finally:
        check(srv.stop() == 0, "exit code")


def case_max_tokens():
    import openai

    srv = Server("-np", "2", "--max-tokens", "5", "-t", "1")
    try:
        line = next(line for line in srv.lines if "listening on" in line)
        check(" 1 thread" in line and " 1 threads" not in line, f"startup line {line!r}")
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        meta = client.models.list().data[0].model_extra["meta"]
        check(meta["max_tokens"] == 5 and meta["default_max_tokens"] == {"completions": 5, "chat": 5}, f"{meta}")
        model = client.models.list().data[0].id
        extra = {"extra_body": {"ignore_eos": True}}
        r = client.completions.create(model=model, prompt="Once upon a time", **extra)
        check(r.usage.completion_tokens == 5, f"default {r.usage}")
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=40, **extra)
        check(r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length", f"capped {r.usage}")
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           **extra)
        check(r.usage.completion_tokens == 3, f"under the cap {r.usage}")
    finally:
        check(srv.stop() == 0, "exit code")
    # Without --max-tokens: no cap; a chat without max_tokens stops at 1,024 tokens, not at the end of the context.
    srv = Server("-np", "1", "-c", "1100", "--attn", "cascade")
    try:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        meta = client.models.list().data[0].model_extra["meta"]
        check(meta["max_tokens"] is None and meta["default_max_tokens"] == {"completions": 16, "chat": 1024}, f"{meta}")
        t0 = time.time()
        # (1,024 steps: 30 s on the shared 2-core machine, minutes under a sanitizer)
        r = client.with_options(timeout=500).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me a story."}], extra_body={"ignore_eos": True})
        check(r.usage.completion_tokens == 1024 and r.choices[0].finish_reason == "length", f"chat default {r.usage}")
        print(f"max_tokens: 1,024 tokens of chat in {time.time() - t0:.1f} s")
        # No cap below the context: more than the context leaves is refused, not cut.
        try:
            client.completions.create(model=model, prompt="Once upon a time", max_tokens=1100)
            fail("max_tokens past the context was accepted")
        except openai.BadRequestError as e:
            check(e.body["code"] == "context_length_exceeded" and e.body["param"] == "max_tokens", f"{e.body}")
    finally:
        check(srv.stop() == 0, "exit code")


def case_client_leaves():
    import openai

    srv = Server("-np", "2", "--attn", "cascade", "--shutdown-timeout", "120")
    try:
        prompt = system_prompt(600)
        status, _, _ = srv.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        check(status == 200, "warm-up")
        idle = srv.wait_idle()
        baseline = idle["cascade_kv_bytes"]
        # The official client gives up after a second and closes its connection: the request is cancelled, its
        # K/V released, and the counter says so.
        impatient = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=1.0, max_retries=0)
        model = impatient.models.list().data[0].id
        t0 = time.time()
        try:
            impatient.completions.create(model=model, prompt=prompt, max_tokens=3000, extra_body={"ignore_eos": True})
            fail("3,000 tokens came back within a second")
        except openai.APITimeoutError:
            pass
        m = srv.wait_idle("the cancelled request to end")
        print(f"client_leaves: the request ended {time.time() - t0:.1f} s after it was sent")
        check(m["cascade_requests_cancelled_total"] == 1, f"cancelled {m['cascade_requests_cancelled_total']}")
        check(m["cascade_kv_bytes"] == baseline and m["cascade_kv_reserved_bytes"] == 0, "its K/V went")
        check(m["cascade_generated_tokens_total"] < 2000, f"{m['cascade_generated_tokens_total']} tokens generated")
        # A client that leaves while the server drains for SIGTERM does not hold the exit up until its 3,000 tokens.
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        data = json.dumps({"prompt": prompt, "max_tokens": 3000, "ignore_eos": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(data) + data)
        deadline = time.time() + TIMEOUT
        while srv.metrics()["cascade_active_sequences"] < 1:
            check(time.time() < deadline, "the request never started")
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.time()
        s.close()
        check(srv.proc.wait(TIMEOUT) == 0, "exit code after SIGTERM")
        took = time.time() - t0
        print(f"client_leaves: exited {took:.1f} s after the client left")
        check(took < 10, f"SIGTERM waited {took:.1f} s for a request whose client had left")
        check(any("every request finished" in line for line in srv.lines), "".join(srv.lines))
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    if CASE not in CASES:
        sys.exit(f"unknown case {CASE!r} (one of {', '.join(CASES)})")
    t0 = time.time()
    CASES[CASE]()
    print(f"server_http_test {CASE}: passed in {time.time() - t0:.1f} s")
