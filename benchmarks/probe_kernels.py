"""One-shot GPU probe of the varlen attention candidates (run once, results go in BENCHMARKS.md)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

H = 16
RESULTS: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "cases": {}}


def cu_of(lengths, slots=None):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    while slots is not None and len(cu) < slots + 1:
        cu.append(cu[-1])
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def reference(q, k, v, cu):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    c = cu.tolist()
    for a, b in zip(c[:-1], c[1:]):
        if b > a:
            s = [t[a:b].float().transpose(0, 1)[None] for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*s)[0].transpose(0, 1)
    return out


def rel(out, ref, end):
    o, r = out[:end].float(), ref[:end]
    return ((o - r).norm() / r.norm()).item()


def time_ms(fn, n=10):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def aten_cudnn(q, k, v, cu, max_seqlen):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_seqlen, max_seqlen, False, 0.0,
                                                   False, False)[0]


def aten_cudnn64(q, k, v, cu, max_seqlen):
    return aten_cudnn(q, k, v, cu.long(), max_seqlen)


def fa2(q, k, v, cu, max_seqlen):
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen)


_fe = {}


def frontend(q, k, v, cu, max_seqlen):
    import cudnn
    t, h, d = q.shape
    b = cu.shape[0] - 1
    key = (t, h, d, b, max_seqlen, q.dtype)
    handle = _fe.setdefault("handle", cudnn.create_handle())
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    if key not in _fe:
        g = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        dims, strides = [b, h, max_seqlen, d], [max_seqlen * h * d, d, h * d, 1]
        rag = g.tensor(name="rag", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        lens = g.tensor(name="lens", dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        qt = g.tensor(name="q", dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16, ragged_offset=rag)
        kt = g.tensor(name="k", dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16, ragged_offset=rag)
        vt = g.tensor(name="v", dim=dims, stride=strides, data_type=cudnn.data_type.BFLOAT16, ragged_offset=rag)
        try:
            o, _ = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, generate_stats=False, attn_scale=d ** -0.5,
                          use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens)
        except TypeError:
            o, _ = g.sdpa(name="sdpa", q=qt, k=kt, v=vt, is_inference=True, attn_scale=d ** -0.5,
                          use_padding_mask=True, seq_len_q=lens, seq_len_kv=lens)
        o.set_output(True).set_dim(dims).set_stride(strides).set_ragged_offset(rag)
        g.validate(); g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support(); g.build_plans()
        ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device="cuda")
        _fe[key] = (g, qt, kt, vt, o, rag, lens, ws)
    g, qt, kt, vt, ot, rag, lens, ws = _fe[key]
    out = torch.empty_like(q)
    ro = (cu * (h * d)).view(-1, 1, 1, 1)
    ln = (cu[1:] - cu[:-1]).view(-1, 1, 1, 1)
    g.execute({qt: q, kt: k, vt: v, ot: out, rag: ro, lens: ln}, ws, handle=handle)
    return out


def fa4(q, k, v, cu, max_seqlen):
    from flash_attn.cute import flash_attn_varlen_func
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                 max_seqlen_k=max_seqlen)
    return out[0] if isinstance(out, tuple) else out


KERNELS = {"aten_cudnn": aten_cudnn, "aten_cudnn_i64": aten_cudnn64, "fa2": fa2, "frontend": frontend, "fa4": fa4}


def check(name, fn, d):
    res = {}
    torch.manual_seed(0)
    rows = 4096
    lengths_a, lengths_b = [1000, 0, 1700, 300], [64, 2000, 0, 1900]
    slots = 8
    q, k, v = (torch.randn(rows, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_a, cu_b = cu_of(lengths_a, slots), cu_of(lengths_b, slots)
    for t in (q, k, v):
        t[cu_a[-1]:] = float("nan")
    t0 = time.perf_counter()
    out = fn(q, k, v, cu_a, 2048)
    torch.cuda.synchronize()
    res["first_call_s"] = round(time.perf_counter() - t0, 3)
    end = int(cu_a[-1])
    res["shape"] = list(out.shape)
    res["rel_err"] = rel(out, reference(q, k, v, cu_a), end)
    res["nan_in_real_rows_with_nan_padding"] = bool(out[:end].isnan().any())
    # isolation: NaN in segment 0 must not reach segment 2
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:1000] = float("nan")
    out2 = fn(q2, k2, v2, cu_a, 2048)
    res["nan_leaks_across_segments"] = bool(out2[1000:end].isnan().any())
    # capture with cu_a, replay with cu_b copied into the same buffer
    cu_buf = cu_a.clone()
    for t in (q, k, v):
        t[cu_a[-1]:] = 0
    fn(q, k, v, cu_buf, 2048)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(q, k, v, cu_buf, 2048)
    cu_buf.copy_(cu_b)
    g.replay()
    torch.cuda.synchronize()
    end_b = int(cu_b[-1])
    res["graph_replay_rel_err_new_offsets"] = rel(static_out, reference(q, k, v, cu_b), end_b)
    return res


def bench(fn, d, lengths, slots=None, rows=None):
    total = sum(lengths)
    rows = rows or total
    cu = cu_of(lengths, slots)
    q, k, v = (torch.randn(rows, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mx = max(lengths) if rows == total else rows
    eager = time_ms(lambda: fn(q, k, v, cu, mx))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(q, k, v, cu, mx)
    graph = time_ms(g.replay)
    return {"eager_ms": round(eager, 4), "graph_ms": round(graph, 4)}


def dense_cudnn(d, seg, n):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(n, H, seg, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return round(time_ms(lambda: F.scaled_dot_product_attention(q, k, v)), 4)


def main():
    names = sys.argv[1:] or list(KERNELS)
    shapes = {"1x9216": [9216], "4x2304": [2304] * 4, "16x256": [256] * 16, "144x64": [64] * 144}
    for d in (80, 72):
        for name in names:
            key = f"{name}_d{d}"
            entry = RESULTS["cases"].setdefault(key, {})
            try:
                entry["check"] = check(name, KERNELS[name], d)
            except Exception as error:  # noqa: BLE001  (a probe records every failure)
                entry["check_error"] = "".join(traceback.format_exception_only(error))[-1500:]
                print(key, traceback.format_exc()[-3000:], flush=True)
                continue
            for label, lengths in shapes.items():
                try:
                    entry[label] = bench(KERNELS[name], d, lengths)
                except Exception as error:  # noqa: BLE001
                    entry[label] = "".join(traceback.format_exception_only(error))[-500:]
            try:
                entry["bucket8192_4real_12empty"] = bench(KERNELS[name], d, [4096, 2304, 576, 576], 16, 8192)
            except Exception as error:  # noqa: BLE001
                entry["bucket"] = "".join(traceback.format_exception_only(error))[-500:]
            print(key, json.dumps(entry), flush=True)
        RESULTS["cases"][f"dense_cudnn_d{d}"] = {
            label: dense_cudnn(d, lengths[0], len(lengths)) for label, lengths in shapes.items()}
    out = os.environ.get("OUT", ".")
    with open(f"{out}/probe.json", "w") as handle:
        json.dump(RESULTS, handle, indent=1)
    print(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
