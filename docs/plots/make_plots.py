#!/usr/bin/env python3
"""Draws the plots of docs/benchmarks.md from benchmark outputs.

  kvstream bench transfer --memory=transport > transfer.txt
  kvstream demo --json=demo.json
  python3 docs/plots/make_plots.py --transfer transfer.txt --demo demo.json --out docs/plots

transfer_gbps.png: kvstream GB/s against layer size per block size (8x128 bf16 shape), with
ucx_perftest (UCX-allocated memory, message = layer) from the same run.
layer_timeline.png: when each layer of the demo's longest request arrived after its hand-off.

  kvstream demo --device=cuda --model=llama3-8b --prompts=... --json=gpu.json
  python3 docs/plots/make_plots.py --gpu-demo gpu.json --tokens 8192

layer_overlap_8k.png: one 8k-token request's layers, compute at the prefill worker and
transfer on one time axis, with each layer's arrival at the decode worker.
Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"^(\S+)\s+(\d+) MiB\s+(\d+) KiB\s+(\d+)\s+([\d.]+) \|\s+([\d.]+)\s+[\d.]+ \|"
                 r"\s+([\d.]+)\s+[\d.]+ \|\s+([\d.]+)\s+[\d.]+")


def transfer_plot(path, out):
    rows = []
    for line in open(path):
        m = ROW.match(line.strip())
        if m:
            shape, mib, kib = m.group(1), int(m.group(2)), int(m.group(3))
            rows.append((shape, mib, kib, float(m.group(5)), float(m.group(8))))
    if not rows:
        raise SystemExit(f"no table rows in {path}")
    shape = "8x128_bf16" if any(r[0] == "8x128_bf16" for r in rows) else rows[0][0]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kib in sorted({r[2] for r in rows if r[0] == shape}):
        pts = sorted((r[1], r[3]) for r in rows if r[0] == shape and r[2] == kib)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"kvstream, {kib} KiB blocks")
    peer = sorted({(r[1], r[4]) for r in rows if r[0] == shape})
    ax.plot([p[0] for p in peer], [p[1] for p in peer], "k--", marker="s",
            label="ucx_perftest put, UCX memory, msg = layer")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layer size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"One layer of scattered blocks between two processes (UCX shm, {shape})")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{out}/transfer_gbps.png", dpi=110)


def timeline_plot(path, out):
    report = json.load(open(path))
    reqs = [r for r in report["requests"] if r.get("layers")]
    if not reqs:
        raise SystemExit(f"no layer timeline in {path}")
    r = max(reqs, key=lambda x: x["prompt_tokens"])
    ms = r["layers"]["layer_arrival_ms"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(range(len(ms)), ms, color="tab:blue")
    ax.set_yticks(range(len(ms)))
    ax.set_yticklabels([f"layer {i}" for i in range(len(ms))])
    ax.invert_yaxis()
    ax.set_xlabel("ms after the request was handed to the prefill worker")
    ax.set_title(f"{r['id']}: {r['prompt_tokens']}-token prompt, layers arrive as they are computed")
    fig.tight_layout()
    fig.savefig(f"{out}/layer_timeline.png", dpi=110)


def overlap_plot(path, out, tokens):
    """One request's layers: compute at the prefill worker, transfer, arrival at the decode worker."""
    report = json.load(open(path))
    reqs = [r for r in report["requests"] if r.get("layers") and r["prompt_tokens"] == tokens]
    if not reqs:
        raise SystemExit(f"no {tokens}-token request with a layer timeline in {path}")
    r = reqs[-1]  # the last of them: the earlier ones warm up
    L = r["layers"]
    ready, start, sent, arrival = (L["layer_ready_ms"], L["layer_copy_start_ms"], L["layer_sent_ms"],
                                   L["layer_arrival_ms"])
    n = len(ready)
    fig, ax = plt.subplots(figsize=(9, 6))
    for l in range(n):
        c0 = L["prefill_start_ms"] if l == 0 else ready[l - 1]
        ax.barh(l - 0.2, ready[l] - c0, left=c0, height=0.38, color="tab:blue",
                label="compute (prefill worker)" if l == 0 else None)
        ax.barh(l + 0.2, max(sent[l] - start[l], 0.05), left=start[l], height=0.38, color="tab:orange",
                label="transfer (copy, until the prefill worker saw it done)" if l == 0 else None)
        ax.plot([arrival[l]], [l + 0.2], "k|", markersize=7,
                label="arrived at the decode worker" if l == 0 else None)
    ax.axvline(r["ttft_ms"], color="tab:red", linestyle="--",
               label=f"first token at the decode worker ({r['ttft_ms']:.1f} ms)")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{l}" for l in range(n)], fontsize=7)
    ax.invert_yaxis()
    ax.set_ylabel("layer")
    ax.set_xlabel("ms after the hand-off")
    ax.set_title(f"{r['prompt_tokens']}-token prompt, Llama-3-8B shapes on one H200: "
                 f"each layer's KV leaves as soon as it is computed\n"
                 f"(transfer after the last layer: {L['last_layer_exposed_ms']:.2f} ms; "
                 f"one layer's transfer, median: {L['median_layer_copy_ms']:.2f} ms)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{out}/layer_overlap_{tokens // 1024}k.png", dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfer", help="output of kvstream bench transfer")
    p.add_argument("--demo", help="JSON report of kvstream demo")
    p.add_argument("--gpu-demo", help="JSON report of kvstream demo --device=cuda --model=llama3-8b")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length of the --gpu-demo plot")
    p.add_argument("--out", default="docs/plots")
    a = p.parse_args()
    if a.transfer:
        transfer_plot(a.transfer, a.out)
    if a.demo:
        timeline_plot(a.demo, a.out)
    if a.gpu_demo:
        overlap_plot(a.gpu_demo, a.out, a.tokens)


if __name__ == "__main__":
    main()
