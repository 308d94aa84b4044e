"""A slow, obviously-correct V4.1 forward pass, straight from the definitions, for tests.

One prompt, no state, no chunking, no batching tricks: every token, every compressed entry and
every attention key is handled one at a time in plain loops, reading the weights of a
DeepseekV41ForCausalLM. The fast path (engine/models/deepseek_v41.py) must agree with it.
Tie rule shared with the fast path (a definition, not an optimisation): among equal index
scores the older entry wins; among equal block scores the older block wins.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvcache.engine.layers.rope import inv_freq


def _rms(x, w, eps):
    x = x.float()
    out = x / torch.sqrt((x * x).mean() + eps)
    return out if w is None else out * w.float()


def _rope(v, pos, freqs, inverse=False):
    """Rotate the last 2*len(freqs) dims of a vector as complex pairs by exp(+-i pos f)."""
    r = 2 * len(freqs)
    z = torch.view_as_complex(v[-r:].float().reshape(-1, 2).contiguous())
    angle = (-1 if inverse else 1) * pos * freqs.double()
    z = z * torch.polar(torch.ones_like(angle), angle).to(z.dtype)
    return torch.cat([v[:-r].float(), torch.view_as_real(z).reshape(-1)])


def _mix(res, fn, base, scale, c):
    n = res.shape[0]
    flat = res.reshape(-1).float()
    mixes = fn.float() @ (flat / torch.sqrt((flat * flat).mean() + c.rms_norm_eps))
    pre = torch.sigmoid(mixes[:n] * scale[0] + base[:n]) + c.hc_eps
    post = 2 * torch.sigmoid(mixes[n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((mixes[2 * n:] * scale[2] + base[2 * n:]).view(n, n), dim=1) + c.hc_eps
    comb = comb / (comb.sum(0, keepdim=True) + c.hc_eps)
    for _ in range(c.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + c.hc_eps)
        comb = comb / (comb.sum(0, keepdim=True) + c.hc_eps)
    return pre, post, comb


def _post(res, out, post, comb):
    n = res.shape[0]
    return torch.stack([post[k] * out + sum(comb[j, k] * res[j] for j in range(n)) for k in range(n)])


def _moe(ffn, x, token, c):
    logits = ffn.gate.weight.float() @ x
    s = torch.sqrt(F.softplus(logits))
    bias = ffn.gate.bias_vl if (c.image_token_id is not None and token == c.image_token_id) else ffn.gate.bias
    order = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]).item(), e))[: ffn.gate.top_k]
    w = torch.stack([s[e] for e in order])
    w = w / (w.sum() + 1e-20) * c.routed_scaling_factor
    out = ffn.shared_experts(x[None])[0]
    for e, we in zip(order, w):
        out = out + we * ffn.experts[e](x[None])[0]
    return out


def _engram_rows(model, ids, slot):
    """Table rows of every position for one engram layer, by the definition (python integers)."""
    c = model.config
    mults, primes, offsets = (a[slot].tolist() for a in model._engram_geometry)
    pad = int(model.token_map[c.engram_pad_token_id])
    rows = []
    for p in range(len(ids)):
        vals, blocked = [], False
        for s in range(c.engram_max_ngram_size):
            q = p - s
            if q < 0 or ids[q] == c.image_token_id:
                blocked = True
            vals.append(pad if blocked else int(model.token_map[ids[q]]))
        r, cols = 0, []
        for s, v in enumerate(vals):
            r ^= v * mults[s]
            r = (r + 2 ** 63) % 2 ** 64 - 2 ** 63             # int64 wrap-around, as the table was built
            if s >= 1:
                for h in range(c.engram_n_heads):
                    col = (s - 1) * c.engram_n_heads + h
                    rows_ = r % primes[col]
                    cols.append(rows_ + offsets[col])
        rows.append(cols)
    return rows


def _engram(layer, res, rows, alive, c):
    e = torch.cat([layer.engram.embed.weight[r].float() for r in rows])
    kv = layer.engram.wkv.weight.float() @ e
    d = c.hidden_size
    value = kv[c.hc_mult * d:]
    out = []
    for k in range(c.hc_mult):
        a = _rms(res[k], layer.engram.q_weight[k], c.rms_norm_eps)
        b = _rms(kv[k * d:(k + 1) * d], layer.engram.k_weight[k], c.rms_norm_eps)
        dot = (a * b).sum() / math.sqrt(d)
        g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6))) if dot != 0 else \
            torch.sigmoid(torch.tensor(1e-3))
        out.append(res[k].float() + (g if alive else 0.0) * value)
    return torch.stack(out)


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    T, n, W = len(ids), c.hc_mult, c.sliding_window
    freqs = {"main": inv_freq(c.qk_rope_head_dim, c.rope_theta, None),
             "compress": inv_freq(c.qk_rope_head_dim, c.compress_rope_theta, c.yarn)}
    res = [model.embed.weight[t].float().expand(n, -1).clone() for t in ids]
    pre_prev = [None] * T
    kv_src = idx_top = cand = None
    for L, layer in enumerate(model.layers):
        a = layer.attn
        if hasattr(layer, "engram"):
            rows = _engram_rows(model, ids, layer.engram.slot)
            res = [_engram(layer, res[t], rows[t], ids[t] != c.image_token_id, c) for t in range(T)]
        mixes = [_mix(res[t], layer.hc_attn_fn, layer.hc_attn_base, layer.hc_attn_scale, c) for t in range(T)]
        xs = [res[t][0] if pre_prev[t] is None else (pre_prev[t][:, None] * res[t]).sum(0) for t in range(T)]
        xs = [_rms(x, layer.attn_norm.weight, c.rms_norm_eps) for x in xs]
        table = freqs["main" if a.kind == "swa" else "compress"]
        qr = [_rms(a.wq_a.weight.float() @ x, a.q_norm.weight, c.rms_norm_eps) for x in xs]
        q = [torch.stack([_rope(h, t, table) for h in (a.wq_b.weight.float() @ qr[t]).view(c.num_attention_heads, -1)])
             for t in range(T)]
        kv = [_rope(_rms(a.wkv.weight.float() @ xs[t], a.kv_norm.weight, c.rms_norm_eps), t, table) for t in range(T)]
        if a.kind != "swa":
            if a.is_kv_source:
                kv_src = _source_entries(a, xs, c, freqs["compress"])
            if a.is_index_source:
                idx_top, cand = _index(a, xs, qr, kv_src, c, freqs["compress"], cand)
        outs = []
        for t in range(T):
            keys = [kv[s] for s in range(max(0, t - W + 1), t + 1)]
            if a.kind != "swa":
                keys += [kv_src[0][j] for j in idx_top[t]]
            K = torch.stack(keys)
            scores = (K @ q[t].T).T / math.sqrt(c.head_dim)                      # [H, S]
            denom = scores.exp().sum(1) + a.attn_sink.float().exp()
            o = (scores.exp() / denom[:, None]) @ K                               # [H, D]
            o = torch.stack([_rope(h, t, table, inverse=True) for h in o])
            g = o.reshape(c.o_groups, -1)
            wo = a.wo_a.weight.float().view(c.o_groups, -1, g.shape[1])
            outs.append(a.wo_b.weight.float() @ torch.cat([wo[i] @ g[i] for i in range(c.o_groups)]))
        res = [_post(res[t], outs[t], mixes[t][1], mixes[t][2]) for t in range(T)]
        fmix = [_mix(res[t], layer.hc_ffn_fn, layer.hc_ffn_base, layer.hc_ffn_scale, c) for t in range(T)]
        ys = [_moe(layer.ffn, _rms((mixes[t][0][:, None] * res[t]).sum(0), layer.ffn_norm.weight, c.rms_norm_eps),
                   ids[t], c) for t in range(T)]
        res = [_post(res[t], ys[t], fmix[t][1], fmix[t][2]) for t in range(T)]
        pre_prev = [fmix[t][0] for t in range(T)]
    final = [_rms((pre_prev[t][:, None] * res[t]).sum(0), model.norm.weight, c.rms_norm_eps) for t in range(T)]
    return torch.stack([model.head.weight.float() @ f for f in final])


def _source_entries(a, xs, c, table):
    """(entries [(j, row)], index keys) of a kv source: each closed group, by its definition."""
    r, D = a.ratio, c.head_dim
    ent, keys = [], []
    for j in range(len(xs) // r):
        rows = [a.compressor.wkv.weight.float() @ xs[j * r + i] for i in range(r)]
        if r == 2:
            gates = [a.compressor.wgate.weight.float() @ xs[j * r + i] for i in range(2)]
            wts = torch.softmax(torch.stack(gates), dim=0)
            pooled = wts[0] * rows[0] + wts[1] * rows[1]
        else:
            pooled = rows[0]
        latent = _rms(pooled, a.compressor.norm.weight, c.rms_norm_eps)
        ent.append(_rope(latent, j * r, table))
        k = _rms(a.indexer.wk.weight.float() @ latent, a.indexer.k_norm.weight, c.rms_norm_eps)
        keys.append(_rope(k, j * r, table))
    assert len(ent[0]) == D
    return ent, keys, r


def _index(a, xs, qr, src, c, table, cand_prev):
    ent, keys, r = src
    tops, cands = [], []
    for t in range(len(xs)):
        q = [_rope(h, t, table) for h in (a.indexer.wq_b.weight.float() @ qr[t]).view(c.index_n_heads, -1)]
        w = (a.indexer.weights_proj.weight.float() @ xs[t]) * c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5
        visible = list(range((t + 1) // r))
        score = {s: sum(w[h] * torch.relu(q[h] @ keys[s]) for h in range(c.index_n_heads)).item() for s in visible}
        allowed = visible
        if a.is_candidate:
            B = c.candidate_block_size
            blocks = sorted({s // B for s in visible})
            newest = (len(visible) - 1) // B if visible else None
            best = {b: (math.inf if b == newest else max(score[s] for s in visible if s // B == b)) for b in blocks}
            keep = sorted(blocks, key=lambda b: (-best[b], b))[: c.candidate_topk_blocks]
            cands.append(set(keep))
        elif a.is_reindex:
            allowed = [s for s in visible if s // c.candidate_block_size in cand_prev[t]]
        top = sorted(allowed, key=lambda s: (-score[s], s))[: c.index_topk]
        tops.append(sorted(top))
    return tops, (cands if a.is_candidate else cand_prev)
