#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (cascade-server, llama.cpp's llama-server): clients that share a
system prompt of P tokens, each request adding a short question of its own and asking for T tokens, streamed.

    serve_bench.py --url http://127.0.0.1:8080 --prompt-ids FILE [options]

--prompt-ids FILE: a JSON object {"system": [ids...], "questions": [[ids...], ...]} (bench/serving.sh writes it
with cascade-tokenize), so every server sees exactly the same token ids.
Arrivals: --clients N closed-loop clients, each sending its next request when the last one ends, for --duration
seconds (or --requests in all); or --rate R Poisson arrivals per second, each request on its own thread.
--warmup-requests 1: before timing, one request and then one per client at once (every slot of the server has seen
the system prompt); 0: none.
--ttft-probe K: instead, K rounds on an idle server, each with a system prompt the server has not seen (the
usual one rotated): one request (uncached), then another with the same system prompt and another question
(cached); prints the TTFT of both, their medians and the ratio cached / uncached.

Per request: time to first token (TTFT: from sending to the first text), time per output token (TPOT: the time
from the first text to the last over the tokens after the first), tokens (the final usage when the server gives
one, else the chunks with text). Prints one JSON object: output tokens/s over the timed window, TTFT and TPOT
p50/p99 (milliseconds), requests answered, refused (429/503) and failed (anything else: a status, a malformed or
cut stream), and with --pid the server's resident memory sampled every second.
"""
import argparse
import http.client
import json
import random
import threading
import time
import urllib.parse


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Result:
    __slots__ = ("t_send", "t_first", "t_end", "tokens", "status", "error")

    def __init__(self):
        self.t_send = self.t_first = self.t_end = None
        self.tokens = 0
        self.status = None
        self.error = None


def one_request(host, port, path, body, timeout):
    """Sends one streamed request; returns a Result (never raises)."""
    r = Result()
    r.t_send = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            resp.read()
            conn.close()
            r.t_end = time.perf_counter()
            return r
        chunks, usage, done = 0, None, False
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                r.error = f"error event: {obj['error']}"
                break
            for c in obj.get("choices") or []:
                text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if text:
                    if r.t_first is None:
                        r.t_first = time.perf_counter()
                    chunks += 1
            if obj.get("usage"):
                usage = obj["usage"]
        conn.close()
        r.t_end = time.perf_counter()
        if not done and r.error is None:
            r.error = "the stream ended without [DONE]"
        r.tokens = usage["completion_tokens"] if usage else chunks
    except Exception as e:  # a failed request is counted, not fatal
        r.error = repr(e)
        r.t_end = time.perf_counter()
    return r


def probe(args, host, port, system, questions):
    rows = []
    for k in range(args.ttft_probe):
        shift = 1 + 97 * k % (len(system) - 1)
        sys_k = system[shift:] + system[:shift]  # a beginning no earlier request had
        times = []
        for q in (questions[2 * k % len(questions)], questions[(2 * k + 1) % len(questions)]):
            req = {"prompt": sys_k + q, "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True}
            if args.model:
                req["model"] = args.model
            r = one_request(host, port, "/v1/completions", json.dumps(req), args.timeout)
            if r.status != 200 or r.error or r.t_first is None:
                raise SystemExit(f"serve_bench: probe request failed: status {r.status}, {r.error}")
            times.append(1e3 * (r.t_first - r.t_send))
        rows.append(times)
    unc = percentile([r[0] for r in rows], 0.5)
    cac = percentile([r[1] for r in rows], 0.5)
    print(json.dumps({"label": args.label, "system_tokens": len(system), "rounds": rows, "ttft_uncached_ms_p50": unc,
                      "ttft_cached_ms_p50": cac, "cached_over_uncached": cac / unc}))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--model", default=None, help="the model name to send (default: none)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0, help="Poisson arrivals per second (0: closed loop)")
    ap.add_argument("--duration", type=float, default=60)
    ap.add_argument("--requests", type=int, default=0, help="stop after this many requests (0: --duration)")
    ap.add_argument("--warmup-requests", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--pid", type=int, default=0, help="the server's process, to sample its resident memory")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--ttft-probe", type=int, default=0)
    ap.add_argument("--unique-tokens", type=int, default=0,
                    help="every 4th request appends this many random token ids (new K/V the cache must evict)")
    return ap.parse_args()


def request_bodies(args, system, questions):
    """body_for(i): request i's JSON: the system prompt, a question, and every 4th time new random tokens."""
    def body_for(i):
        prompt = system + questions[i % len(questions)]
        if args.unique_tokens and i % 4 == 3:
            prompt = prompt + [random.Random(i).randrange(1000, 40000) for _ in range(args.unique_tokens)]
        req = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        if args.model:
            req["model"] = args.model
        return json.dumps(req)
    return body_for


def warm_up(args, host, port, body_for):
    """Not timed: one request, then (closed loop) a round of one per client at once, so every slot of a server
    that keeps a prompt per slot has seen the system prompt too."""
    for batch in ([0], list(range(1, 1 + args.clients))) if args.warmup_requests else ():
        warm = [None] * len(batch)
        ts = [threading.Thread(target=lambda k=k, w=w: warm.__setitem__(
            k, one_request(host, port, "/v1/completions", body_for(w), args.timeout))) for k, w in enumerate(batch)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for r in warm:
            if r.status != 200 or r.error:
                raise SystemExit(f"serve_bench: a warm-up request failed: status {r.status}, {r.error}")


def run_load(args, host, port, body_for):
    """The timed run: closed loop (--clients) or Poisson arrivals (--rate) until --requests or --duration.
    Returns (results, seconds, rss samples)."""
    counter = [0]
    lock = threading.Lock()
    results = []
    t0 = time.perf_counter()
    deadline = t0 + args.duration

    def take_index():
        with lock:
            if args.requests and counter[0] >= args.requests:
                return None
            if not args.requests and time.perf_counter() >= deadline:
                return None
            counter[0] += 1
            return counter[0] - 1

    def record(r):
        with lock:
            results.append(r)

    rss = []
    sampling = [True]

    def sample_rss():
        while sampling[0]:
            v = rss_kib(args.pid)
            if v is not None:
                rss.append((time.perf_counter() - t0, v))
            time.sleep(1.0)

    if args.pid:
        threading.Thread(target=sample_rss, daemon=True).start()

    threads = []
    if args.rate <= 0:
        def client():
            while (i := take_index()) is not None:
                r = one_request(host, port, "/v1/completions", body_for(i), args.timeout)
                record(r)
                if r.status in (429, 503):
                    time.sleep(1.0)  # the servers' Retry-After

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
    else:
        rng = random.Random(args.seed)
        t_next = t0
        while (i := take_index()) is not None:
            t_next += rng.expovariate(args.rate)
            time.sleep(max(0.0, t_next - time.perf_counter()))
            t = threading.Thread(target=lambda i=i: record(one_request(host, port, "/v1/completions", body_for(i),
                                                                         args.timeout)))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    sampling[0] = False
    return results, seconds, rss


def summary(args, system, results, seconds, rss):
    """The run's one JSON object: counts, output tokens per second, TTFT and TPOT percentiles, memory."""
    ok = [r for r in results if r.status == 200 and r.error is None]
    refused = [r for r in results if r.status in (429, 503)]
    failed = [r for r in results if r not in ok and r not in refused]
    ttft = [1e3 * (r.t_first - r.t_send) for r in ok if r.t_first is not None]
    tpot = [1e3 * (r.t_end - r.t_first) / (r.tokens - 1) for r in ok if r.t_first is not None and r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    out = {
        "label": args.label,
        "clients": args.clients,
        "rate": args.rate,
        "system_tokens": len(system),
        "max_tokens": args.max_tokens,
        "seconds": seconds,
        "requests": len(results),
        "answered": len(ok),
        "refused": len(refused),
        "failed": len(failed),
        "failures": sorted({f"status {r.status}: {r.error}" for r in failed})[:5],
        "unique_tokens": args.unique_tokens,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "ttft_ms_p50": percentile(ttft, 0.5),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "tpot_ms_p50": percentile(tpot, 0.5),
        "tpot_ms_p99": percentile(tpot, 0.99),
    }
    if rss:
        out["rss_mib"] = [[round(t, 1), round(v / 1024, 1)] for t, v in rss]
    return out


def main():
    args = parse_args()
    u = urllib.parse.urlparse(args.url)
    host, port = u.hostname, u.port or 80
    with open(args.prompt_ids) as f:
        ids = json.load(f)
    system, questions = ids["system"], ids["questions"]
    if args.ttft_probe:
        probe(args, host, port, system, questions)
        return
    body_for = request_bodies(args, system, questions)
    warm_up(args, host, port, body_for)
    results, seconds, rss = run_load(args, host, port, body_for)
    print(json.dumps(summary(args, system, results, seconds, rss)))


if __name__ == "__main__":
    main()
