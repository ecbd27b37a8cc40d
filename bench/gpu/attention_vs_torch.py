#!/usr/bin/env python3
"""kvstream's CUDA attention beside torch's scaled_dot_product_attention, on the same tensors.

Loads libkvstream_torch_shim.so (built with the CUDA parts of kvstream: bench/gpu/) through
ctypes and hands it the device pointers of torch tensors, so kvstream and torch read exactly
the same inputs in one process, on torch's current stream.

  python3 bench/gpu/attention_vs_torch.py --lib BUILD/bench/gpu/libkvstream_torch_shim.so \
      [--check] [--bench] [--json FILE]

--check  paged prefill, chunked prefill, decode and mixed batches (bf16/fp16 queries, 16-bit
         and fp8 caches, GQA, head sizes 64/128/256, NHD and HND, causal and bidirectional,
         sliding window, ALiBi): kvstream's output against SDPA on the gathered, dequantised
         K/V; fails (exit 1) when the largest difference passes the tolerance or when either
         side has a NaN.
--bench  prefill (bf16, causal, d128, 4k/8k/16k/32k tokens, 32/8 heads, block size 16 and
         64): kvstream TFLOP/s beside SDPA's flash and cuDNN backends (medians of
         PREFILL_ROUNDS interleaved rounds, each led by another side, each timing at least
         100 ms of launches after 50 ms of untimed ones, with the range of the per-round
         ratios to cuDNN); decode (bf16, 32/8 heads, d128, block size 16, 64 x 4k and 16 x
         32k): TB/s of KV read beside SDPA (enable_gqa, not paged), each backend forced and
         the plain call (torch's own backend choice), with ratios to the fastest backend and
         to the plain call. Decode is timed in DECODE_ROUNDS interleaved rounds (kvstream,
         then each torch variant) and reports each side's median, with the range of the
         per-round ratios to the plain call, so that a drift of the GPU's clocks or memory
         during the run does not decide the ratio.
Neither flag: both.
"""
import argparse
import ctypes
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class Args(ctypes.Structure):
    # Field by field as KvsAttentionArgs in torch_shim.cc.
    _fields_ = [
        ("q", ctypes.c_uint64), ("out", ctypes.c_uint64),
        ("q_dtype", ctypes.c_char_p), ("out_dtype", ctypes.c_char_p),
        ("q_token_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64),
        ("o_token_stride", ctypes.c_int64), ("o_head_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("k_cache", ctypes.c_uint64), ("v_cache", ctypes.c_uint64),
        ("cache_dtype", ctypes.c_char_p),
        ("k_block_stride", ctypes.c_int64), ("k_token_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("v_block_stride", ctypes.c_int64), ("v_token_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("head_size", ctypes.c_int32), ("head_size_v", ctypes.c_int32),
        ("k_scale_host", ctypes.c_uint64), ("v_scale_host", ctypes.c_uint64),
        ("num_scales", ctypes.c_int32),
        ("query_start_loc", ctypes.c_uint64), ("seq_lens", ctypes.c_uint64),
        ("block_table", ctypes.c_uint64),
        ("host_query_start_loc", ctypes.c_uint64), ("host_seq_lens", ctypes.c_uint64),
        ("host_block_table", ctypes.c_uint64),
        ("block_table_stride", ctypes.c_int64),
        ("num_seqs", ctypes.c_int32), ("max_query_len", ctypes.c_int32),
        ("max_seq_len", ctypes.c_int32), ("num_heads", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("causal", ctypes.c_int32), ("sliding_window", ctypes.c_int32),
        ("soft_cap", ctypes.c_float),
        ("alibi_slopes", ctypes.c_uint64), ("host_alibi_slopes", ctypes.c_uint64),
        ("stream", ctypes.c_uint64),
        ("iterations", ctypes.c_int32),
    ]


DTYPE_NAMES = {
    torch.float32: b"float32", torch.float16: b"float16", torch.bfloat16: b"bfloat16",
    torch.float8_e4m3fn: b"fp8_e4m3", torch.float8_e5m2: b"fp8_e5m2",
}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class Problem:
    """A batch over a paged cache, built in torch on the GPU, with host copies of the batch."""

    def __init__(self, seqs, num_heads, num_kv_heads, head_size, head_size_v=None,
                 q_dtype=torch.bfloat16, cache_dtype=None, block_size=16, layout="NHD",
                 causal=True, window=0, alibi=False, per_head_scales=False, seed=0):
        # seqs: list of (context_len, query_len)
        head_size_v = head_size_v or head_size
        cache_dtype = cache_dtype or q_dtype
        g = torch.Generator(device="cpu").manual_seed(seed)
        dev = "cuda"
        self.seqs, self.h, self.kvh = seqs, num_heads, num_kv_heads
        self.d, self.dv, self.q_dtype, self.cache_dtype = head_size, head_size_v, q_dtype, cache_dtype
        self.bs, self.layout, self.causal, self.window = block_size, layout, causal, window
        seq_lens = [c + q for c, q in seqs]
        blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
        self.num_blocks = sum(blocks_per_seq) + 7
        perm = torch.randperm(self.num_blocks, generator=g).tolist()
        width = max(blocks_per_seq)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        self.block_ids = []
        at = 0
        for i, n in enumerate(blocks_per_seq):
            ids = perm[at:at + n]
            at += n
            table[i, :n] = torch.tensor(ids, dtype=torch.int32)
            self.block_ids.append(ids)
        self.table_host = table
        self.table = table.to(dev)
        qsl = [0]
        for _, q in seqs:
            qsl.append(qsl[-1] + q)
        self.qsl_host = torch.tensor(qsl, dtype=torch.int32)
        self.qsl = self.qsl_host.to(dev)
        self.seq_lens_host = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens = self.seq_lens_host.to(dev)
        self.num_tokens = qsl[-1]
        self.q = (torch.randn(self.num_tokens, num_heads, head_size, generator=g) * 0.5).to(dev, q_dtype)
        self.out = torch.full((self.num_tokens, num_heads, head_size_v), float("nan"), device=dev,
                              dtype=q_dtype)
        # Logical K/V of every sequence, then quantised and scattered into the paged cache.
        nscales = num_kv_heads if per_head_scales else 1
        is_fp8 = cache_dtype in FP8_MAX
        self.k_scale = (torch.rand(nscales, generator=g) * 0.02 + 0.01) if is_fp8 else torch.ones(1)
        self.v_scale = (torch.rand(nscales, generator=g) * 0.02 + 0.01) if is_fp8 else torch.ones(1)
        shape_k = (self.num_blocks, block_size, num_kv_heads, head_size)
        shape_v = (self.num_blocks, block_size, num_kv_heads, head_size_v)
        if layout == "NHD":
            self.k_cache = torch.zeros(shape_k, dtype=cache_dtype, device=dev)
            self.v_cache = torch.zeros(shape_v, dtype=cache_dtype, device=dev)
            k_view, v_view = self.k_cache, self.v_cache
        else:  # HND storage, viewed logically as NHD
            self.k_cache = torch.zeros((self.num_blocks, num_kv_heads, block_size, head_size),
                                       dtype=cache_dtype, device=dev)
            self.v_cache = torch.zeros((self.num_blocks, num_kv_heads, block_size, head_size_v),
                                       dtype=cache_dtype, device=dev)
            k_view, v_view = self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        self.k_view, self.v_view = k_view, v_view
        # Every block gets random values (drawn on the device); a sequence's K/V is whatever
        # its blocks hold, read back through the block table by gathered().
        dg = torch.Generator(device=dev).manual_seed(seed)
        for view, scales, spread in ((k_view, self.k_scale, 0.5), (v_view, self.v_scale, 1.0)):
            x = torch.randn(view.shape, generator=dg, device=dev) * spread
            if is_fp8:
                lim = FP8_MAX[cache_dtype]
                x = (x / scales.to(dev).view(1, 1, -1, 1)).clamp(-lim, lim)
            view.copy_(x.to(cache_dtype))
            del x
        self.slopes_host = (torch.rand(num_heads, generator=g) * 0.1) if alibi else None
        self.slopes = self.slopes_host.to(dev) if alibi else None

    def gathered(self, i):
        """Sequence i's K and V, dequantised to float32: [n, kvh, d]."""
        n = self.seqs[i][0] + self.seqs[i][1]
        ids = torch.tensor(self.block_ids[i], device="cuda", dtype=torch.long)
        k = self.k_view[ids].reshape(-1, self.kvh, self.d)[:n].float()
        v = self.v_view[ids].reshape(-1, self.kvh, self.dv)[:n].float()
        if self.cache_dtype in FP8_MAX:
            k = k * self.k_scale.cuda().view(1, -1, 1)
            v = v * self.v_scale.cuda().view(1, -1, 1)
        return k, v

    def args(self, scale, stream, iterations=1, soft_cap=0.0):
        kst = self.k_view.stride()
        vst = self.v_view.stride()
        a = Args()
        a.q, a.out = self.q.data_ptr(), self.out.data_ptr()
        a.q_dtype = a.out_dtype = DTYPE_NAMES[self.q_dtype]
        a.q_token_stride, a.q_head_stride = self.q.stride(0), self.q.stride(1)
        a.o_token_stride, a.o_head_stride = self.out.stride(0), self.out.stride(1)
        a.num_tokens = self.num_tokens
        a.k_cache, a.v_cache = self.k_cache.data_ptr(), self.v_cache.data_ptr()
        a.cache_dtype = DTYPE_NAMES[self.cache_dtype]
        a.k_block_stride, a.k_token_stride, a.k_head_stride = kst[0], kst[1], kst[2]
        a.v_block_stride, a.v_token_stride, a.v_head_stride = vst[0], vst[1], vst[2]
        a.num_blocks = self.num_blocks
        a.block_size, a.num_kv_heads, a.head_size, a.head_size_v = self.bs, self.kvh, self.d, self.dv
        self._ks = self.k_scale.float().contiguous()  # kept alive: host pointers
        self._vs = self.v_scale.float().contiguous()
        if self.cache_dtype in FP8_MAX:
            a.k_scale_host, a.v_scale_host = self._ks.data_ptr(), self._vs.data_ptr()
            a.num_scales = self._ks.numel()
        a.query_start_loc, a.seq_lens, a.block_table = (
            self.qsl.data_ptr(), self.seq_lens.data_ptr(), self.table.data_ptr())
        a.host_query_start_loc = self.qsl_host.data_ptr()
        a.host_seq_lens = self.seq_lens_host.data_ptr()
        a.host_block_table = self.table_host.data_ptr()
        a.block_table_stride = self.table.stride(0)
        a.num_seqs = len(self.seqs)
        a.max_query_len = max(q for _, q in self.seqs)
        a.max_seq_len = max(c + q for c, q in self.seqs)
        a.num_heads = self.h
        a.scale = scale
        a.causal = 1 if self.causal else 0
        a.sliding_window = self.window
        a.soft_cap = soft_cap
        if self.slopes is not None:
            a.alibi_slopes, a.host_alibi_slopes = self.slopes.data_ptr(), self.slopes_host.data_ptr()
        a.stream = stream
        a.iterations = iterations
        return a


def run_kvstream(lib, args):
    err = ctypes.create_string_buffer(1024)
    rc = lib.kvstream_attention_forward(ctypes.byref(args), err, len(err))
    if rc != 0:
        raise RuntimeError(f"kvstream_attention_forward: code {rc}: {err.value.decode()}")


def sdpa_reference(p, scale):
    """SDPA per sequence on the gathered K/V (float32 math), in the query dtype's layout."""
    outs = []
    group = p.h // p.kvh
    for i, (ctx, ql) in enumerate(p.seqs):
        if ql == 0:
            continue
        n = ctx + ql
        k, v = p.gathered(i)
        q = p.q[p.qsl_host[i]: p.qsl_host[i + 1]].float()
        qpos = torch.arange(ctx, n, device="cuda").view(-1, 1)
        kpos = torch.arange(n, device="cuda").view(1, -1)
        allowed = torch.ones(ql, n, dtype=torch.bool, device="cuda")
        if p.causal:
            allowed &= kpos <= qpos
        if p.window > 0:
            allowed &= (qpos - kpos).abs() <= p.window - 1
        bias = torch.zeros(p.h, ql, n, device="cuda")
        if p.slopes is not None:
            bias += p.slopes.view(-1, 1, 1) * (kpos - qpos).float().view(1, ql, n)
        bias = bias.masked_fill(~allowed.view(1, ql, n), float("-inf"))
        kk = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
        vv = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
        qq = q.transpose(0, 1).unsqueeze(0)
        with sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=bias.unsqueeze(0), scale=scale)
        o = torch.nan_to_num(o, nan=0.0)  # rows that see no key: kvstream writes zeros
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def check(lib, report):
    cases = [
        dict(name="prefill bf16 d128 gqa4", seqs=[(0, 517), (0, 130), (0, 7)], h=32, kvh=8, d=128),
        dict(name="chunked+decode mixed", seqs=[(300, 64), (1000, 1), (17, 33), (0, 1)], h=16, kvh=4, d=128),
        dict(name="decode batch", seqs=[(n - 1, 1) for n in (1, 15, 16, 17, 4096, 333)], h=32, kvh=8, d=128),
        dict(name="fp16 d64 mha", seqs=[(0, 300), (50, 50)], h=8, kvh=8, d=64, q_dtype=torch.float16),
        dict(name="d256 mqa", seqs=[(0, 200), (100, 1)], h=8, kvh=1, d=256),
        dict(name="head 192/v128", seqs=[(0, 150), (40, 20)], h=8, kvh=2, d=192, dv=128),
        dict(name="fp8 e4m3 per tensor", seqs=[(0, 400), (256, 1)], h=32, kvh=8, d=128,
             cache_dtype=torch.float8_e4m3fn),
        dict(name="fp8 e5m2 per head HND", seqs=[(0, 97), (500, 1)], h=16, kvh=4, d=128,
             cache_dtype=torch.float8_e5m2, per_head=True, layout="HND"),
        dict(name="HND block 5", seqs=[(0, 123), (77, 1)], h=8, kvh=2, d=128, bs=5, layout="HND"),
        dict(name="bidirectional", seqs=[(0, 211), (30, 31)], h=8, kvh=2, d=128, causal=False),
        dict(name="sliding window 70", seqs=[(0, 400), (900, 1), (64, 64)], h=8, kvh=2, d=128, window=70),
        dict(name="alibi", seqs=[(0, 300), (120, 1)], h=8, kvh=2, d=128, alibi=True),
    ]
    stream = torch.cuda.current_stream().cuda_stream
    ok = True
    for c in cases:
        p = Problem(c["seqs"], c["h"], c["kvh"], c["d"], c.get("dv"), c.get("q_dtype", torch.bfloat16),
                    c.get("cache_dtype"), c.get("bs", 16), c.get("layout", "NHD"), c.get("causal", True),
                    c.get("window", 0), c.get("alibi", False), c.get("per_head", False))
        scale = 1.0 / math.sqrt(c["d"])
        run_kvstream(lib, p.args(scale, stream))
        torch.cuda.synchronize()
        ref = sdpa_reference(p, scale)
        got = p.out.float()
        nan = bool(torch.isnan(got).any() or torch.isnan(ref).any())
        diff = (got - ref).abs().max().item() if not nan else float("nan")
        tol = 2e-2 if c.get("q_dtype", torch.bfloat16) == torch.bfloat16 else 5e-3
        passed = (not nan) and diff <= tol
        ok &= passed
        print(f"check {c['name']:<26} max|kvstream - sdpa| = {diff:.2e}  tol {tol:.0e}  "
              f"{'ok' if passed else 'FAIL'}")
        report.setdefault("check", []).append({"case": c["name"], "max_abs_diff": diff, "ok": passed})
    return ok


DECODE_ROUNDS = 5
PREFILL_ROUNDS = 3
PREFILL_TOKENS = (4096, 8192, 16384, 32768)


def time_ms(fn, iters):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def time_sustained_ms(fn, min_ms=100.0):
    """Milliseconds per call of fn under a steady load: a first call (plans, caches), a second
    that sizes the run, about min_ms / 2 of untimed calls that bring the clocks to where such
    a load keeps them (a GPU at its power cap runs a short burst faster than a long one),
    then time_ms over at least min_ms (and at least 10 calls)."""
    once = max(time_ms(fn, 1), 1e-3)
    for _ in range(math.ceil(min_ms / 2 / once)):
        fn()
    return time_ms(fn, max(10, math.ceil(min_ms / once)))


def bench(lib, report):
    stream = torch.cuda.current_stream().cuda_stream
    # Prefill: one sequence of n tokens, causal, 32/8 heads, d128, bf16, block size 16 and 64.
    h, kvh, d = 32, 8, 128
    scale = 1.0 / math.sqrt(d)
    for n in PREFILL_TOKENS:
        for bs in (16, 64):
            p = Problem([(0, n)], h, kvh, d, block_size=bs, seed=1)
            flops = 4.0 * n * n * d * h / 2
            a = p.args(scale, stream, iterations=1)
            k, v = p.gathered(0)
            qq = p.q.transpose(0, 1).unsqueeze(0).contiguous()
            kk = k.to(torch.bfloat16).repeat_interleave(h // kvh, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
            vv = v.to(torch.bfloat16).repeat_interleave(h // kvh, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
            row = {"shape": f"prefill b1 h{h} kv{kvh} n{n} d{d} causal bf16 bs{bs}"}
            ms = {"kvstream": [], "flash": [], "cudnn": []}

            def timed(backend):
                if backend is None:
                    return time_sustained_ms(lambda: run_kvstream(lib, a))
                with sdpa_kernel(backend):
                    return time_sustained_ms(lambda: F.scaled_dot_product_attention(
                        qq, kk, vv, is_causal=True, scale=scale))

            sides = [("kvstream", None), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION)]
            # Interleaved rounds, each starting with the next side, so that neither a drift of
            # the clock nor the side run just before (a hotter or cooler GPU) picks a winner.
            for r in range(PREFILL_ROUNDS):
                for name, backend in sides[r % len(sides):] + sides[:r % len(sides)]:
                    if ms[name] is None:
                        continue
                    try:
                        ms[name].append(timed(backend))
                    except RuntimeError as e:  # backend not available for this shape or build
                        ms[name] = None
                        print(f"  torch {name}: unavailable ({str(e).splitlines()[0]})")
            tf = {name: (flops / statistics.median(v) / 1e9 if v else None) for name, v in ms.items()}
            row["kvstream_tflops"] = tf["kvstream"]
            row["torch_flash_tflops"] = tf["flash"]
            row["torch_cudnn_tflops"] = tf["cudnn"]
            fl, cd = tf["flash"], tf["cudnn"]
            per_round_text = ""
            if ms["cudnn"]:
                per_round = [cd_ms / kv_ms for kv_ms, cd_ms in zip(ms["kvstream"], ms["cudnn"])]
                row["ratio_vs_cudnn_per_round"] = per_round
                per_round_text = f"; cudnn ratio per round {min(per_round):.2f}-{max(per_round):.2f}"
            print(f"{row['shape']}: kvstream {tf['kvstream']:.1f} TFLOP/s | torch flash "
                  f"{fl or float('nan'):.1f} (ratio {tf['kvstream'] / fl if fl else float('nan'):.2f}) | "
                  f"torch cudnn {cd or float('nan'):.1f} (ratio {tf['kvstream'] / cd if cd else float('nan'):.2f})"
                  f" (medians of {PREFILL_ROUNDS} rounds{per_round_text})", flush=True)
            report.setdefault("bench", []).append(row)
            del p, k, v, qq, kk, vv
            torch.cuda.empty_cache()

    # Decode: bf16, 32/8 heads, d128, block size 16.
    for batch, n in ((64, 4096), (16, 32768)):
        p = Problem([(n - 1, 1)] * batch, h, kvh, d, seed=2)
        kv_bytes = 2.0 * batch * n * kvh * d * 2
        a = p.args(scale, stream, iterations=1)
        # torch on contiguous (not paged) K/V with native GQA: [b, kvh, n, d].
        kc = torch.randn(batch, kvh, n, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(batch, kvh, n, d, device="cuda", dtype=torch.bfloat16)
        qc = torch.randn(batch, h, 1, d, device="cuda", dtype=torch.bfloat16)

        def sdpa():
            return F.scaled_dot_product_attention(qc, kc, vc, scale=scale, enable_gqa=True)

        backends = {"flash": SDPBackend.FLASH_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION,
                    "cudnn": SDPBackend.CUDNN_ATTENTION}
        ms = {name: [] for name in ("kvstream", "default", *backends)}
        for _ in range(DECODE_ROUNDS):
            ms["kvstream"].append(time_ms(lambda: run_kvstream(lib, a), 50))
            for name, backend in backends.items():
                if ms[name] is None:
                    continue
                try:
                    with sdpa_kernel(backend):
                        ms[name].append(time_ms(sdpa, 50))
                except RuntimeError as e:  # backend not available for this shape or build
                    ms[name] = None
                    print(f"  torch {name}: unavailable ({str(e).splitlines()[0]})")
            # The plain call, as an engine would make it: torch picks the backend itself.
            ms["default"].append(time_ms(sdpa, 50))
        tbps = {name: (kv_bytes / statistics.median(v) / 1e9 if v else None) for name, v in ms.items()}
        row = {"shape": f"decode b{batch} h{h} kv{kvh} n{n} d{d} bf16 paged bs16",
               "rounds": DECODE_ROUNDS, "kvstream_tbps": tbps["kvstream"],
               "torch_default_tbps": tbps["default"]}
        best = None
        for name in backends:
            row[f"torch_{name}_tbps"] = tbps[name]
            if tbps[name] is not None and (best is None or tbps[name] > best[1]):
                best = (name, tbps[name])
        ratio = row["kvstream_tbps"] / best[1] if best else float("nan")
        row["ratio_vs_best_torch"] = ratio
        row["ratio_vs_default_torch"] = row["kvstream_tbps"] / row["torch_default_tbps"]
        per_round = [t / k for k, t in zip(ms["kvstream"], ms["default"])]
        row["ratio_vs_default_torch_per_round"] = per_round
        print(f"{row['shape']}: kvstream {row['kvstream_tbps']:.2f} TB/s | best torch "
              f"({best[0] if best else 'none'}) {best[1] if best else float('nan'):.2f} TB/s | ratio {ratio:.2f}"
              f" | torch's own choice {row['torch_default_tbps']:.2f} TB/s | ratio "
              f"{row['ratio_vs_default_torch']:.3f} (medians of {DECODE_ROUNDS} rounds; per round "
              f"{min(per_round):.3f}-{max(per_round):.3f})")
        report.setdefault("bench", []).append(row)
        del p, kc, vc, qc
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", required=True, help="path to libkvstream_torch_shim.so")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device visible to torch")
        return 0
    lib = ctypes.CDLL(opts.lib)
    lib.kvstream_attention_forward.argtypes = [ctypes.POINTER(Args), ctypes.c_char_p, ctypes.c_int]
    lib.kvstream_attention_forward.restype = ctypes.c_int
    do_check = opts.check or not opts.bench
    do_bench = opts.bench or not opts.check
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if do_check:
        ok = check(lib, report)
    if do_bench:
        bench(lib, report)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
