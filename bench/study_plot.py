#!/usr/bin/env python3
"""Plots and summary numbers of bench/study.sh's run: python3 bench/study_plot.py OUTDIR

Reads OUTDIR/raw/kernel-*.json (cascade-bench rows), OUTDIR/raw/recheck-*.json (points re-timed with more
repetitions), OUTDIR/raw/decode-*.json (cascade-generate --json) and, when study.sh ran with --llama-cpp,
OUTDIR/raw/llama-cpp-*.json (the same decode runs by llama.cpp), writes OUTDIR/fig/*.png,
OUTDIR/summary.json and OUTDIR/summary.md. Plots need matplotlib; without it the summary is still written and
the script says which figures it skipped.

python3 bench/study_plot.py --recheck-list OUTDIR prints, one per line, the cascade-bench flags of every
kernel point where auto took more than 5% over the best fixed method or over split (study.sh re-times them).
"""
import glob
import json
import math
import os
import re
import sys

METHODS = ["unified", "split", "cascade", "auto"]
COLORS = {"unified": "tab:red", "split": "tab:orange", "cascade": "tab:blue", "auto": "tab:green"}


def load_kernel(raw):
    sweeps = {}
    for path in sorted(glob.glob(os.path.join(raw, "kernel-*.json"))):
        name = os.path.basename(path)[len("kernel-"):-len(".json")]
        with open(path) as f:
            sweeps[name] = json.load(f)
    return sweeps


def load_recheck(raw):
    rows = []
    for path in sorted(glob.glob(os.path.join(raw, "recheck-*.json"))):
        with open(path) as f:
            try:
                rows += json.load(f)
            except json.JSONDecodeError:
                continue
    return rows


def load_decode(raw):
    runs = {}
    for path in sorted(glob.glob(os.path.join(raw, "decode-*.json"))):
        m = re.match(r"decode-(.+)-(unified|split|cascade|auto)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError:
                continue
        # Sequences active at step i: those that had produced more than i tokens when it ran (the first
        # token is sampled from the prompt's logits, so decode step i feeds token i).
        lens = [len(s["tokens"]) + (1 if s["stop"] == "eog" else 0) for s in d["sequences"]]
        d["active"] = [sum(1 for n in lens if n > i) for i in range(len(d["step_ms"]))]
        runs.setdefault(m.group(1), {})[m.group(2)] = d
    return runs


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def windows(n):
    """Step windows the seed quotes (around decode 40, 440, 2320), those that exist in an n-step run."""
    out = []
    for centre in (40, 440, 2320):
        if centre <= n:
            out.append((f"steps {max(0, centre - 20)}-{centre}", max(0, centre - 20), centre))
    if not out or out[-1][2] < n:
        out.append((f"last 20 (to {n})", max(0, n - 20), n))
    if n >= 1 and out[0][1] > 0:
        out.insert(0, ("first 20", 0, min(20, n)))
    return out


def summarize_decode(runs):
    summary = {}
    for name, by in runs.items():
        n = min(len(d["step_ms"]) for d in by.values())
        entry = {"n_steps": n, "methods": {}}
        any_d = next(iter(by.values()))
        entry["n_parallel"] = any_d["n_parallel"]
        entry["n_prompt_tokens"] = any_d["n_prompt_tokens"]
        entry["model"] = os.path.basename(any_d["model"])
        for meth, d in by.items():
            e = {"decode_ms": d["decode_ms"], "attn_ms": d["attn_ms"], "kv_bytes": d["kv_bytes"],
                 "calibrate_ms": d.get("calibrate_ms", 0),
                 "prompt_ms": d["prompt_ms"], "min_active": min(d["active"][:n]) if n else 0, "windows": {}}
            for label, a, b in windows(n):
                e["windows"][label] = {"step_ms": mean(d["step_ms"][a:b]), "attn_ms": mean(d["step_attn_ms"][a:b])}
            entry["methods"][meth] = e
        summary[name] = entry
    return summary


def key(r):
    return (r["n_q_heads"], r["n_kv_heads"], r["head_dim"], r["kv_dtype"], r["batch"], r["prefix"], r["suffix"],
            r["threads"])


def by_config(rows):
    cfg = {}
    for r in rows:
        cfg.setdefault(key(r), {})[r["method"]] = r
    return cfg


def summarize_kernel(sweeps):
    out = {}
    for name, rows in sweeps.items():
        cfgs = by_config(rows)
        items = []
        for k, ms in sorted(cfgs.items()):
            it = {"heads": f"{k[0]}/{k[1]}/{k[2]}", "kv_dtype": k[3], "batch": k[4], "prefix": k[5], "suffix": k[6],
                  "median_ms": {m: ms[m]["median_ms"] for m in ms},
                  "fraction": {m: ms[m]["fraction"] for m in ms},
                  "limit_ms": next(iter(ms.values()))["limit_ms"]}
            best = min(v for m, v in it["median_ms"].items() if m in ("cascade", "split"))
            it["best_of_cascade_split_ms"] = best
            if "unified" in ms:
                it["unified_over_best"] = it["median_ms"]["unified"] / best
            if "cascade" in ms and "split" in ms:
                it["split_over_cascade"] = it["median_ms"]["split"] / it["median_ms"]["cascade"]
            if "cascade" in ms and "unified" in ms:
                it["unified_over_cascade"] = it["median_ms"]["unified"] / it["median_ms"]["cascade"]
            if "auto" in ms:
                # against the best of every fixed method measured (unified included)
                fixed = min(v for m, v in it["median_ms"].items() if m in ("cascade", "split", "unified"))
                a = it["median_ms"]["auto"]
                it["auto_over_best"] = a / fixed
                it["best_over_auto"] = fixed / a
                if "split" in ms:
                    it["auto_over_split"] = a / it["median_ms"]["split"]
                it["auto_cv"] = ms["auto"].get("stdev_ms", 0) / a if a > 0 else 0
            items.append(it)
        out[name] = items
    return out


def crossovers(kernel):
    """Per grid sweep and batch: the smallest prefix from which cascade beats split by 5% or more, and the
    worst / best of auto against the better of cascade and split."""
    res = {}
    for name, items in kernel.items():
        if not name.startswith("grid-"):
            continue
        per_b = {}
        for it in items:
            per_b.setdefault(it["batch"], []).append(it)
        rows = []
        for b, its in sorted(per_b.items()):
            its.sort(key=lambda x: x["prefix"])
            def from_prefix(field):
                # the smallest P from which cascade wins by 5% at every larger P of the sweep (one noisy
                # point below does not move it)
                first = None
                for x in reversed(its):
                    if x.get(field, 0) >= 1.05:
                        first = x["prefix"]
                    else:
                        break
                return first
            rows.append({"batch": b, "cascade_beats_split_from_prefix": from_prefix("split_over_cascade"),
                         "cascade_beats_unified_from_prefix": from_prefix("unified_over_cascade"),
                         "prefixes": [x["prefix"] for x in its]})
        autos = [x["auto_over_best"] for x in items if "auto_over_best" in x]
        res[name] = {"per_batch": rows, "auto_over_best_max": max(autos) if autos else None,
                     "auto_over_best_mean": mean(autos) if autos else None}
    return res


def over_5pct(x):
    return x.get("auto_over_best", 0) > 1.05 or x.get("auto_over_split", 0) > 1.05


def recheck_args(kernel):
    out = []
    for items in kernel.values():
        for x in items:
            if over_5pct(x):
                a = (f"--heads {x['heads']} --batch {x['batch']} --prefix {x['prefix']} --suffix {x['suffix']} "
                     f"--kv-dtype {x['kv_dtype']}")
                if a not in out:
                    out.append(a)
    return out


def auto_check(kernel, recheck=None):
    """auto against the best fixed method and against split, over every point of every kernel sweep; the
    points over 5% again as re-timed with more repetitions (recheck: summarize_kernel of those rows)."""
    pts = [(name, x) for name, items in kernel.items() for x in items if "auto_over_best" in x]
    if not pts:
        return None
    again = {}
    for x in (recheck or []):
        again[(x["heads"], x["kv_dtype"], x["batch"], x["prefix"], x["suffix"])] = x
    rechecked = []
    for n, x in pts:
        if over_5pct(x):
            y = again.get((x["heads"], x["kv_dtype"], x["batch"], x["prefix"], x["suffix"]))
            if y is not None and "auto_over_best" in y:
                rechecked.append({"sweep": n, "batch": x["batch"], "prefix": x["prefix"], "suffix": x["suffix"],
                                  "kv_dtype": x["kv_dtype"], "heads": x["heads"],
                                  "first": x["auto_over_best"], "first_split": x.get("auto_over_split"),
                                  "again": y["auto_over_best"], "again_split": y.get("auto_over_split"),
                                  "again_ms": y["median_ms"]})
    over = [x["auto_over_best"] for _, x in pts]
    vs_split = [x["auto_over_split"] for _, x in pts if "auto_over_split" in x]
    worst = max(pts, key=lambda p: p[1]["auto_over_best"])
    return {"points": len(pts), "mean": mean(over), "worst": max(over),
            "worst_at": f"{worst[0]}: B={worst[1]['batch']} P={worst[1]['prefix']} t={worst[1]['suffix']} "
                        f"{worst[1]['kv_dtype']}",
            "over_5pct": [f"{n}: B={x['batch']} P={x['prefix']} t={x['suffix']} {x['kv_dtype']} "
                          f"({x['auto_over_best']:.2f}, auto's run-to-run spread {100 * x['auto_cv']:.0f}%)"
                          for n, x in pts if x["auto_over_best"] > 1.05],
            "split_worst": max(vs_split) if vs_split else None,
            "split_over_5pct": sum(1 for v in vs_split if v > 1.05),
            "rechecked": rechecked}


def fmt(x, p=2):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"


def write_md(path, machine, dec, kernel, cross, ac):
    L = ["# Study summary (generated by bench/study_plot.py)", "", "```", machine.strip(), "```", ""]
    for name, e in dec.items():
        L.append(f"## decode: {name} ({e['model']}, {e['n_parallel']} sequences, {e['n_prompt_tokens']}-token prompt,"
                 f" {e['n_steps']} steps)")
        L.append("")
        meths = [m for m in METHODS if m in e["methods"]]
        labels = list(next(iter(e["methods"].values()))["windows"].keys())
        L.append("| window | " + " | ".join(f"{m} step ms (attn ms)" for m in meths) + " | unified/cascade step |"
                 " split/cascade step | unified/cascade attn |")
        L.append("|---" * (len(meths) + 4) + "|")
        for lab in labels:
            w = {m: e["methods"][m]["windows"][lab] for m in meths}
            c = w.get("cascade")
            def ratio(m, f):
                return fmt(w[m][f] / c[f]) if c and m in w and c[f] > 0 else "-"
            L.append(f"| {lab} | " + " | ".join(f"{w[m]['step_ms']:.1f} ({w[m]['attn_ms']:.1f})" for m in meths) +
                     f" | {ratio('unified', 'step_ms')} | {ratio('split', 'step_ms')} | {ratio('unified', 'attn_ms')} |")
        L.append("")
        L.append("| method | decode s | attention s | K/V MiB at end | fewest active sequences | calibration s |")
        L.append("|---|---|---|---|---|---|")
        for m in meths:
            x = e["methods"][m]
            L.append(f"| {m} | {x['decode_ms'] / 1e3:.1f} | {x['attn_ms'] / 1e3:.1f} | {x['kv_bytes'] / 2**20:.1f} |"
                     f" {x['min_active']} | {x['calibrate_ms'] / 1e3:.2f} |")
        L.append("")
    for name, items in kernel.items():
        L.append(f"## kernel sweep: {name}")
        L.append("")
        L.append("| heads | kv | B | P | t | unified ms | split ms | cascade ms | auto ms | limit ms | "
                 "unified/best | split/cascade | auto/best fixed | auto/split | cascade of limit |")
        L.append("|---" * 15 + "|")
        for it in items:
            ms = it["median_ms"]
            L.append(f"| {it['heads']} | {it['kv_dtype']} | {it['batch']} | {it['prefix']} | {it['suffix']} | "
                     f"{fmt(ms.get('unified'), 3)} | {fmt(ms.get('split'), 3)} | {fmt(ms.get('cascade'), 3)} | "
                     f"{fmt(ms.get('auto'), 3)} | {fmt(it['limit_ms'], 3)} | {fmt(it.get('unified_over_best'))} | "
                     f"{fmt(it.get('split_over_cascade'))} | {fmt(it.get('auto_over_best'))} | {fmt(it.get('auto_over_split'))} | "
                     f"{fmt(100 * it['fraction'].get('cascade', float('nan')), 0)}% |")
        L.append("")
    for name, c in cross.items():
        L.append(f"## crossovers: {name}")
        L.append("")
        L.append("| B | cascade beats split by >=5% at every P from | cascade beats unified by >=5% at every P from |")
        L.append("|---|---|---|")
        for r in c["per_batch"]:
            L.append(f"| {r['batch']} | {r['cascade_beats_split_from_prefix'] or 'never in ' + str(r['prefixes'])} | "
                     f"{r['cascade_beats_unified_from_prefix'] or 'never in ' + str(r['prefixes'])} |")
        L.append("")
        L.append(f"auto / best fixed method: mean {fmt(c['auto_over_best_mean'])}, worst "
                 f"{fmt(c['auto_over_best_max'])}")
        L.append("")
    if ac:
        L.append("## auto against the fixed methods, every kernel point")
        L.append("")
        L.append(f"{ac['points']} points: auto / best of (unified, split, cascade) mean {fmt(ac['mean'])}, worst "
                 f"{fmt(ac['worst'])} ({ac['worst_at']}); auto / split worst {fmt(ac['split_worst'])}, "
                 f"{ac['split_over_5pct']} points over 1.05.")
        L.append("")
        L.append("Points where auto is more than 5% over the best fixed method: " +
                 ("; ".join(ac["over_5pct"]) if ac["over_5pct"] else "none") + ".")
        L.append("")
        if ac["rechecked"]:
            L.append("Every point over 5% (against the best fixed method or against split), timed again with more "
                     "interleaved repetitions of each method (25, or 5 with --quick; up to 5x that under 1 ms):")
            L.append("")
            L.append("| sweep | heads | kv | B | P | t | auto/best fixed, first | auto/split, first | "
                     "auto/best fixed, again | auto/split, again | unified, split, cascade, auto ms (again) |")
            L.append("|---" * 11 + "|")
            for r in ac["rechecked"]:
                ms = r["again_ms"]
                L.append(f"| {r['sweep']} | {r['heads']} | {r['kv_dtype']} | {r['batch']} | {r['prefix']} | "
                         f"{r['suffix']} | {fmt(r['first'])} | {fmt(r['first_split'])} | {fmt(r['again'])} | "
                         f"{fmt(r['again_split'])} | " +
                         ", ".join(fmt(ms.get(m), 3) for m in ("unified", "split", "cascade", "auto")) + " |")
            L.append("")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def rolling(xs, w):
    if w <= 1:
        return xs
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def decode_plots(plt, out, runs):
    """Step time and attention time against step, per decode run."""
    made = []
    # Step time and attention time against step, per decode run.
    for name, by in runs.items():
        fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
        n = max(len(d["step_ms"]) for d in by.values())
        w = max(1, n // 60)
        for m in METHODS:
            if m not in by:
                continue
            d = by[m]
            xs = list(range(1, len(d["step_ms"]) + 1))
            axes[0].plot(xs, rolling(d["step_ms"], w), label=m, color=COLORS[m], lw=1.3)
            axes[1].plot(xs, rolling(d["step_attn_ms"], w), label=m, color=COLORS[m], lw=1.3)
        d0 = next(iter(by.values()))
        axes[0].set_title(f"{name}: {d0['n_parallel']} sequences, {d0['n_prompt_tokens']}-token shared prompt"
                          + (f" (mean of {w} steps)" if w > 1 else ""))
        axes[0].set_ylabel("decode step (ms)")
        axes[1].set_ylabel("attention in the step (ms)")
        axes[1].set_xlabel("decode step")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.legend()
        who = next(m for m in by if by[m] is d0)
        act = d0["active"]
        if act and min(act) < max(act):
            ax2 = axes[0].twinx()
            ax2.plot(range(1, len(act) + 1), act, color="gray", ls=":", lw=1)
            ax2.set_ylabel(f"active sequences, {who} run (dotted)")
            ax2.set_ylim(0, max(act) * 1.1)
        fig.tight_layout()
        p = os.path.join(out, "fig", f"decode-{name}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    return made


def grid_plots(plt, out, kernel):
    """Per prefix x batch grid: cascade's speedups, and the fraction of the machine's limit."""
    made = []
    # Speedup heatmaps of cascade over unified and over split, prefix x batch.
    for name, items in kernel.items():
        if not name.startswith("grid-"):
            continue
        bs = sorted({it["batch"] for it in items})
        ps = sorted({it["prefix"] for it in items})
        look = {(it["batch"], it["prefix"]): it for it in items}
        panels = [("unified_over_cascade", "cascade speedup over unified"),
                  ("split_over_cascade", "cascade speedup over split"),
                  ("best_over_auto", "best fixed method / auto: 1 = auto as fast as the best")]
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for ax, (field, title) in zip(axes, panels):
            grid = [[look.get((b, p), {}).get(field, float("nan")) for b in bs] for p in ps]
            lg = [[math.log2(v) if v == v and v > 0 else float("nan") for v in row] for row in grid]
            im = ax.imshow(lg, cmap="RdBu", vmin=-3, vmax=3, origin="lower", aspect="auto")
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(bs)), [str(b) for b in bs])
            ax.set_yticks(range(len(ps)), [str(p) for p in ps])
            ax.set_xlabel("batch B (sequences)")
            ax.set_title(title, fontsize=10)
        axes[0].set_ylabel("shared prefix P (tokens)")
        fig.colorbar(im, ax=axes, label="log2 of the ratio (blue: > 1)", shrink=0.8)
        it0 = items[0]
        fig.suptitle(f"{name}: heads {it0['heads']}, {it0['kv_dtype']} K/V, {it0['suffix']} own tokens per sequence")
        p = os.path.join(out, "fig", f"kernel-speedup-{name[len('grid-'):]}.png")
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(p)

        # Fraction of the machine's limit reached, against batch, one panel per prefix.
        fig, axes = plt.subplots(1, len(ps), figsize=(3.4 * len(ps), 3.6), sharey=True)
        axes = axes if len(ps) > 1 else [axes]
        for ax, pr in zip(axes, ps):
            for m in METHODS:
                ys = [look[(b, pr)]["fraction"].get(m, float("nan")) if (b, pr) in look else float("nan") for b in bs]
                ax.plot(bs, [100 * y for y in ys], marker="o", ms=3, label=m, color=COLORS[m])
            ax.set_xscale("log", base=2)
            ax.set_title(f"P = {pr}")
            ax.set_xlabel("B")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("% of the machine's limit")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{name}: limit = max(minimum bytes / read bandwidth, minimum FLOPs / matrix rate)")
        fig.tight_layout()
        p = os.path.join(out, "fig", f"kernel-fraction-{name[len('grid-'):]}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)

    return made


def suffix_plot(plt, out, kernel):
    """Time against own tokens per sequence (the seed's growth)."""
    made = []
    # Time against own tokens per sequence (the seed's growth), and dtype bars.
    sfx = [n for n in kernel if n.startswith("suffix")]
    if sfx:
        fig, axes = plt.subplots(1, len(sfx), figsize=(6 * len(sfx), 4))
        axes = axes if len(sfx) > 1 else [axes]
        for ax, name in zip(axes, sfx):
            items = kernel[name]
            ts = [it["suffix"] for it in items]
            for m in METHODS:
                ax.plot(ts, [it["median_ms"].get(m, float("nan")) for it in items], marker="o", label=m, color=COLORS[m])
            ax.plot(ts, [it["limit_ms"] for it in items], ls="--", color="black", label="machine limit")
            it0 = items[0]
            ax.set_title(f"{name}: heads {it0['heads']}, B={it0['batch']}, P={it0['prefix']}")
            ax.set_xlabel("own tokens per sequence t")
            ax.set_ylabel("attention, one decode step (ms)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(out, "fig", "kernel-suffix.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


def dtype_plot(plt, out, kernel):
    """Time per K/V dtype."""
    made = []
    if "dtype" in kernel:
        items = kernel["dtype"]
        labels = [f"{it['kv_dtype']} B={it['batch']}" for it in items]
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.2
        for i, m in enumerate(METHODS):
            ax.bar([j + (i - 1.5) * width for j in range(len(items))],
                   [it["median_ms"].get(m, 0) for it in items], width, label=m, color=COLORS[m])
        ax.set_xticks(range(len(items)), labels)
        ax.set_ylabel("attention, one decode step (ms)")
        it0 = items[0]
        ax.set_title(f"K/V dtype: heads {it0['heads']}, P={it0['prefix']}, t={it0['suffix']}")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        p = os.path.join(out, "fig", "kernel-dtype.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


def plots(out, runs, sweeps, kernel):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return (decode_plots(plt, out, runs) + grid_plots(plt, out, kernel) + suffix_plot(plt, out, kernel)
            + dtype_plot(plt, out, kernel))

# --- llama.cpp beside cascade (study.sh --llama-cpp) -----------------------------------------------------------

LLAMA_CONFIGS = ["unified", "unified+fa", "streams", "streams+fa"]
LLAMA_COLORS = {"unified": "tab:purple", "unified+fa": "tab:pink", "streams": "tab:brown", "streams+fa": "tab:gray"}


def load_llama(raw):
    runs = {}
    for path in sorted(glob.glob(os.path.join(raw, "llama-cpp-*.json"))):
        m = re.match(r"llama-cpp-(.+)-(unified|unified\+fa|streams|streams\+fa)\.json$", os.path.basename(path))
        if not m:
            continue
        with open(path) as f:
            try:
                runs.setdefault(m.group(1), {})[m.group(2)] = json.load(f)
            except json.JSONDecodeError:
                continue
    return runs


def step_at(d, centre, width=20):
    xs = d["step_ms"][max(0, centre - width):centre]
    return mean(xs)


def summarize_llama(llama, runs):
    """Per decode run: llama.cpp's four configurations, its best, and cascade's default (auto) against them."""
    out = {}
    for name, cfgs in llama.items():
        e = {"configs": {}}
        for cfg, d in cfgs.items():
            n = len(d["step_ms"])
            e["configs"][cfg] = {"decode_tokens_per_s": d["decode_tokens_per_s"], "prompt_ms": d["prompt_ms"],
                                 "n_steps": n, "step40_ms": step_at(d, min(40, n)), "last_ms": mean(d["step_ms"][-20:]),
                                 "n_prompt_tokens": d["n_prompt_tokens"]}
        for c in e["configs"].values():
            c["growth"] = c["last_ms"] / c["step40_ms"] if c["step40_ms"] > 0 else float("nan")
        best = max(e["configs"], key=lambda c: e["configs"][c]["decode_tokens_per_s"])
        e["best"] = best
        ours = runs.get(name, {}).get("auto") or runs.get(name, {}).get("cascade")
        if ours:
            n = len(ours["step_ms"])
            c = {"attn": ours["attn"], "decode_tokens_per_s": ours["decode_tokens_per_s"], "prompt_ms": ours["prompt_ms"],
                 "step40_ms": step_at(ours, min(40, n)), "last_ms": mean(ours["step_ms"][-20:]), "n_steps": n,
                 "n_prompt_tokens": ours["n_prompt_tokens"],
                 "linear_path": ours.get("linear_products", ours.get("linear_path", "?"))}
            c["growth"] = c["last_ms"] / c["step40_ms"] if c["step40_ms"] > 0 else float("nan")
            e["cascade"] = c
            b = e["configs"][best]
            e["decode_over_best"] = c["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            e["prefill_over_best"] = b["prompt_ms"] / c["prompt_ms"]
            for u in ("unified+fa", "unified"):
                if u in e["configs"]:
                    e["decode_over_" + u] = c["decode_tokens_per_s"] / e["configs"][u]["decode_tokens_per_s"]
        out[name] = e
    return out


def write_llama_md(path, lsum):
    if not lsum:
        return
    L = ["", "## llama.cpp beside cascade (same model, prompt, sampling and threads)", ""]
    for name, e in lsum.items():
        L.append(f"### {name}")
        L.append("")
        L.append("| engine, configuration | decode tokens/s | ms per step, steps 20-40 | last 20 steps | growth | "
                 "prompt eval s |")
        L.append("|---|---|---|---|---|---|")
        c = e.get("cascade")
        if c:
            L.append(f"| cascade-generate --attn {c['attn']} (linear {c['linear_path']}) | {c['decode_tokens_per_s']:.1f} | "
                     f"{c['step40_ms']:.1f} | {c['last_ms']:.1f} | {fmt(c['growth'])}x | {c['prompt_ms'] / 1e3:.2f} |")
        for cfg in LLAMA_CONFIGS:
            if cfg in e["configs"]:
                x = e["configs"][cfg]
                L.append(f"| llama.cpp {cfg}{' (best)' if cfg == e['best'] else ''} | {x['decode_tokens_per_s']:.1f} | "
                         f"{x['step40_ms']:.1f} | {x['last_ms']:.1f} | {fmt(x['growth'])}x | {x['prompt_ms'] / 1e3:.2f} |")
        L.append("")
        if c:
            extra = "".join(f", {fmt(e['decode_over_' + u])}x its {u}" for u in ("unified+fa", "unified")
                            if "decode_over_" + u in e)
            L.append(f"cascade decodes {fmt(e['decode_over_best'])}x llama.cpp's best ({e['best']}){extra}; "
                     f"its prompt eval is {fmt(e['prefill_over_best'])}x as fast as the best configuration's.")
            L.append("")
    with open(path, "a") as f:
        f.write("\n".join(L) + "\n")


def plot_llama(out, llama, runs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for name, cfgs in llama.items():
        fig, ax = plt.subplots(figsize=(9, 4.5))
        n = max(len(d["step_ms"]) for d in cfgs.values())
        w = max(1, n // 60)
        for m in ("auto", "cascade"):
            if m in runs.get(name, {}):
                d = runs[name][m]
                ax.plot(range(1, len(d["step_ms"]) + 1), rolling(d["step_ms"], w), color=COLORS[m], lw=1.6,
                        label=f"cascade --attn {m}")
        for cfg in LLAMA_CONFIGS:
            if cfg in cfgs:
                d = cfgs[cfg]
                ax.plot(range(1, len(d["step_ms"]) + 1), rolling(d["step_ms"], w), color=LLAMA_COLORS[cfg], lw=1.2,
                        ls="--", label=f"llama.cpp {cfg}")
        d0 = next(iter(cfgs.values()))
        ax.set_title(f"{name}: {d0['n_parallel']} sequences, {d0['n_prompt_tokens']}-token shared prompt"
                     + (f" (mean of {w} steps)" if w > 1 else ""))
        ax.set_xlabel("decode step")
        ax.set_ylabel("decode step (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(out, "fig", f"llama-cpp-{name}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p)
    return made


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--recheck-list":
        for a in recheck_args(summarize_kernel(load_kernel(os.path.join(sys.argv[2], "raw")))):
            print(a)
        return
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = sys.argv[1]
    raw = os.path.join(out, "raw")
    os.makedirs(os.path.join(out, "fig"), exist_ok=True)
    sweeps, runs = load_kernel(raw), load_decode(raw)
    kernel = summarize_kernel(sweeps)
    dec = summarize_decode(runs)
    cross = crossovers(kernel)
    machine = open(os.path.join(raw, "machine.txt")).read() if os.path.exists(os.path.join(raw, "machine.txt")) else ""
    recheck = summarize_kernel({"recheck": load_recheck(raw)}).get("recheck", [])
    ac = auto_check(kernel, recheck)
    llama = load_llama(raw)
    lsum = summarize_llama(llama, runs)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"decode": dec, "kernel": kernel, "crossovers": cross, "auto_check": ac, "llama_cpp": lsum}, f,
                  indent=1)
    write_md(os.path.join(out, "summary.md"), machine, dec, kernel, cross, ac)
    write_llama_md(os.path.join(out, "summary.md"), lsum)
    try:
        made = plots(out, runs, sweeps, kernel) + plot_llama(out, llama, runs)
        print(f"study_plot: {len(made)} figures in {os.path.join(out, 'fig')}", file=sys.stderr)
    except ImportError:
        print("study_plot: matplotlib is missing: summary written, figures skipped", file=sys.stderr)


if __name__ == "__main__":
    main()
