"""Gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh 2024): a sequential reference, a chunked
PyTorch path in the WY / UT-transform form, a single-step update for decoding, and fla's kernels on CUDA.

Semantics (shapes as fla's ``chunk_gated_delta_rule``: b batch, t time, h heads, K key dim, V value dim)::

    q, k  = l2norm(q), l2norm(k)                   (only with use_qk_l2norm; eps 1e-6 inside the sqrt, as fla)
    q     = q * scale                              (scale defaults to K ** -0.5)
    S_t   = exp(g_t) S_{t-1}                       (b, h, K, V); g is the gate in log space (<= 0)
    u_t   = beta_t (v_t - S_t^T k_t)               the delta rule: write only what S does not predict yet
    S_t   = S_t + k_t u_t^T
    o_t   = S_t^T q_t                              (b, t, h, V)

`reset` (b, t) bool marks the first token of each document in a packed sequence: the state is zeroed before
that token, so nothing crosses a document start (exact in every path). Everything runs in fp32; the output
comes back in v's dtype, the final state in fp32.

Implementations (``impl=``):

- ``"ref"``: a plain loop over time (the oracle the others are tested against).
- ``"chunked"``: ``CHUNK`` steps at a time. Inside a chunk (c = 0..C-1, G = within-chunk cumsum of g,
  M[i, j] = exp(G_i - G_j) for j <= i in the same document, else 0) the delta-rule writes solve the
  unit-lower-triangular system (I + L) u = beta (v - exp(G) k S_0) with L[i, j] = beta_i (k_i . k_j) M[i, j],
  j < i, for whatever state S_0 enters the chunk. With Tb = (I + L)^-1 diag(beta) (one small triangular solve
  per chunk, for all chunks at once) u = Tb (v - exp(G) k S_0), o = ((q k^T) * M) u + exp(G) q S_0, and the
  next state is S_C = exp(G_C) S_0 + k^T (exp(G_C - G) u). Only those products with S are sequential over
  chunks: one loop over chunks forward and one backward, each on the chunk's block of every row and head while
  it is in cache. Every exp is of a non-positive number, so strong decay underflows harmlessly (to ~0). Forward
  and backward are written by hand, in one autograd Function (`_factors` / `_factors_backward` for the small
  (C, C) factors, `_scan` / `_scan_backward` for the loops), and checked against autograd through `"ref"`.
- ``"cpu"``: ``"chunked"`` with its two loops over chunks (`_scan`, `_scan_backward`) as C++ on CPU
  (`csrc/gated_delta_cpu.cpp` in `kernels/scan_cpu.py`'s module): one task per (batch row, head) walks the chunks
  with its (K, V) state in cache, the products single-threaded gemms on the chunk's blocks. Without document
  masks the loops also make each chunk's l2-normed keys and queries and its factors, and their gradients
  (`_ChunkedGatedDeltaCPU`, `FUSE_FACTORS`), while the chunk's rows are in cache; with them those stay the torch
  path's, and so does the autograd Function. Checked against ``"ref"`` by the same tests as ``"chunked"``, both
  ways.
- ``"fla"``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (flash-linear-attention, CUDA tensors). With
  `reset` the batch is flattened into one sequence with ``cu_seqlens`` (fla's varlen form); a call with both
  `reset` and `initial_state` falls back to ``"chunked"``.
- ``"auto"`` (default): ``"fla"`` when fla imports and q is on CUDA, else ``"cpu"`` where the C++ module built
  and there are at least as many (batch row, head) pairs as torch threads, else ``"chunked"``.
  ``ARCHSCALE_SCAN_IMPL`` (the Mamba scans' variable; its ``cuda`` means ``fla`` here) replaces auto.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl, cuda_impl
from archscale.kernels.selective_scan import ENV_VAR

CHUNK = 64  # chunked path: steps per chunk (fla's and transformers' choice; see benchmarks/gdn_throughput.py)
# impl "cpu" without document masks: the keys' and queries' l2norm and layout and the per-chunk factors, and
# their gradients, made inside the C++ chunk loops (each chunk's while its rows are in cache) instead of batched
# in torch (`_ChunkedGatedDeltaCPU`); False keeps them in torch, as with document masks (tests run both)
FUSE_FACTORS = True

_FLA: dict[str, object] = {}


def _fla(name: str):
    """fla's `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule`, or None when not installed (cached)."""
    if name not in _FLA:
        try:
            import fla.ops.gated_delta_rule as ops
            _FLA[name] = getattr(ops, name)
        except Exception:  # ImportError, or a broken Triton/CUDA setup raising at import
            _FLA[name] = None
    return _FLA[name]


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla("chunk_gated_delta_rule") is not None


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _enough_tasks(x: Tensor, **_) -> bool:
    """The C++ loop runs one task per (batch row, head): with fewer than torch's threads some would sit idle,
    where the torch loop's batched products use them all."""
    return x.dim() == 4 and x.shape[0] * x.shape[2] >= torch.get_num_threads()


def _has_state_and_resets(initial_state: Tensor | None = None, reset: Tensor | None = None, **_) -> bool:
    return reset is not None and initial_state is not None  # fla's varlen form: one initial state per document


GATED_DELTA = Dispatch("gated_delta_rule", (
    cuda_impl("fla", lambda: _fla("chunk_gated_delta_rule"), "flash-linear-attention",
              steps_aside=_has_state_and_resets, instead="chunked"),
    Impl("cpu", scan_cpu.unavailable_for, in_auto=_enough_tasks),
    Impl("chunked"),
    Impl("ref"),
), env_var=ENV_VAR, aliases={"cuda": "fla"})  # ARCHSCALE_SCAN_IMPL, as the Mamba scans; their "cuda" is fla here
IMPLS = GATED_DELTA.choices


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                     initial_state: Tensor | None = None, output_final_state: bool = False,
                     reset: Tensor | None = None, use_qk_l2norm: bool = True, impl: str = "auto",
                     chunk_size: int = CHUNK) -> tuple[Tensor, Tensor | None]:
    """q, k (b, t, h, K); v (b, t, h, V); g, beta (b, t, h); initial_state (b, h, K, V) or None;
    reset (b, t) bool or None. Returns (o (b, t, h, V) in v's dtype, final state (b, h, K, V) fp32 or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = GATED_DELTA.resolve(impl, x=q, initial_state=initial_state, reset=reset)
    if impl == "fla":
        return _fla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, reset, use_qk_l2norm)
    with torch.autocast(device_type=q.device.type, enabled=False):
        h0 = None if initial_state is None else initial_state.float()
        if impl == "ref":
            gb = [x.float().transpose(1, 2) for x in (g, beta)]              # (b, h, t)
            qf, kf = q.float(), k.float()
            if use_qk_l2norm:
                qf, kf = l2norm(qf), l2norm(kf)
            qkv = [x.transpose(1, 2) for x in (qf * scale, kf, v.float())]   # (b, h, t, ...)
            o, last = _recurrence_ref(*qkv, *gb, h0, reset)
            return o.transpose(1, 2).to(v.dtype), (last if output_final_state else None)
        o, last = _chunked(q, k, v, g, beta, h0, reset, chunk_size, scale, use_qk_l2norm, output_final_state,
                           fused=impl == "cpu")
    return o.to(v.dtype), last


def gated_delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                     scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """One decoding step. state (b, h, K, V) fp32 is updated in place; q, k (b, h, K); v (b, h, V); g, beta
    (b, h). Returns o (b, h, V) in v's dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.autocast(device_type=q.device.type, enabled=False):
        qf, kf = q.float(), k.float()
        if use_qk_l2norm:
            qf, kf = l2norm(qf), l2norm(kf)
        S = state * g.float().exp()[..., None, None]
        u = beta.float()[..., None] * (v.float() - torch.einsum("bhk,bhkv->bhv", kf, S))
        S = S + kf[..., :, None] * u[..., None, :]
        state.copy_(S)
        o = torch.einsum("bhk,bhkv->bhv", qf * scale, S)
    return o.to(v.dtype)


# --------------------------------------------------------------------------------------------------------------
# Reference: one step at a time, exactly the recurrence. Differentiable through autograd.

def _recurrence_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None,
                    reset: Tensor | None) -> tuple[Tensor, Tensor]:
    """q, k (b, h, t, K) (q already normalised and scaled); v (b, h, t, V); g, beta (b, h, t)."""
    b, h, t, K = k.shape
    S = h0 if h0 is not None else k.new_zeros(b, h, K, v.shape[-1])
    outs = []
    for i in range(t):
        decay = g[:, :, i].exp()
        if reset is not None:
            decay = decay * (~reset[:, i]).to(decay.dtype)[:, None]  # a new document starts from 0
        S = S * decay[..., None, None]
        u = beta[:, :, i, None] * (v[:, :, i] - torch.einsum("bhk,bhkv->bhv", k[:, :, i], S))
        S = S + k[:, :, i, :, None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, i], S))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, S


# --------------------------------------------------------------------------------------------------------------
# Chunked: the UT transform inside chunks, the state passed between chunks. Every tensor is chunk-major,
# (n, b, h, C, ...), so chunk c of all rows and heads is one contiguous block that the loops below read while
# it is still in cache.

def _chunk_major(x: Tensor, C: int) -> Tensor:
    """(b, n C, h, ...) -> a (n, b, h, C, ...) view."""
    return x.unflatten(1, (x.shape[1] // C, C)).transpose(0, 1).transpose(2, 3)  # splitting t: always a view


class _KeysOverQueries(torch.autograd.Function):
    """k, q (b, t, h, K) -> fp32 (n, b, h, 2C, K): chunk c's keys stacked over its queries, each row
    l2-normalised (y = x rsqrt(sum x^2 + 1e-6)) when asked. One fused pass each way; the backward
    dx = r (dy - y (y . dy)) is written straight into x's layout."""

    @staticmethod
    def forward(ctx, k, q, C, normalise):
        b, t, h, K = k.shape
        y = torch.empty(t // C, b, h, 2, C, K, dtype=torch.float32, device=k.device)
        rs = []
        for i, x in enumerate((k, q)):
            xf = x.float()
            if normalise:
                r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().add_(1e-6).rsqrt_()  # (b, t, h, 1)
                torch.mul(_chunk_major(xf, C), _chunk_major(r, C), out=y[:, :, :, i])
                rs.append(r)
            else:
                y[:, :, :, i].copy_(_chunk_major(xf, C))
        y = y.view(t // C, b, h, 2 * C, K)
        ctx.save_for_backward(y, *rs)
        ctx.dtypes, ctx.C = (k.dtype, q.dtype), C
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y, *rs = ctx.saved_tensors
        n, b, h, C2, K = y.shape
        C = ctx.C
        y, dy = y.view(n, b, h, 2, C, K), dy.view(n, b, h, 2, C, K)
        grads = []
        for i, dtype in enumerate(ctx.dtypes):
            dx = torch.empty(b, n * C, h, K, dtype=torch.float32, device=y.device)
            if rs:
                yi, dyi = y[:, :, :, i], dy[:, :, :, i]
                dot = (yi * dyi).sum(-1, keepdim=True)
                torch.addcmul(dyi, yi, dot, value=-1.0, out=_chunk_major(dx, C)).mul_(_chunk_major(rs[i], C))
            else:
                _chunk_major(dx, C).copy_(dy[:, :, :, i])
            grads.append(dx.to(dtype))
        return grads[0], grads[1], None, None


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None,
             reset: Tensor | None, chunk: int, scale: float, normalise: bool,
             need_last: bool, fused: bool = False) -> tuple[Tensor, Tensor | None]:
    """q, k (b, t, h, K), v (b, t, h, V), g, beta (b, t, h), in the caller's layout and dtype. Returns o (b, t, h, V)
    fp32 and the final state (None unless `need_last`). Pads t to a multiple of the chunk with g = 0, beta = 0,
    k = q = 0 steps (decay 1, no write), so the state carries through the padding unchanged. `fused`: the loops
    over chunks on the C++ module."""
    b, t, h, K = k.shape
    V = v.shape[-1]
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"gated_delta_rule: chunk_size must be a power of two (got {chunk})")
    if t == 0:
        last = h0 if h0 is not None else k.new_zeros(b, h, K, V, dtype=torch.float32)
        return v.new_zeros(v.shape, dtype=torch.float32), (last if need_last else None)
    C = min(chunk, 1 << (t - 1).bit_length())                                # a short input: one chunk
    pad = -t % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        reset = None if reset is None else F.pad(reset, (0, pad), value=False)
    if fused and reset is None and FUSE_FACTORS:
        k, q, v = (x.float() if x.stride(-1) == 1 else x.float().contiguous() for x in (k, q, v))
        o, last = _ChunkedGatedDeltaCPU.apply(k, q, v, _chunk_major(g.float(), C), _chunk_major(beta.float(), C),
                                              h0, C, scale, normalise, need_last)
        return o[:, :t], (last if need_last else None)
    kq = _KeysOverQueries.apply(k, q, C, normalise)                          # (n, b, h, 2C, K)
    same, fresh = _document_masks(reset, b, kq.shape[0], C)                  # (n, b, 1, C, C), (n, b, 1, C)
    o, last = _ChunkedGatedDelta.apply(kq, v.float(), _chunk_major(g.float(), C), _chunk_major(beta.float(), C),
                                       h0, same, fresh, scale, need_last, fused)
    return o[:, :t], (last if need_last else None)


class _ChunkedGatedDelta(torch.autograd.Function):
    """The chunked form after the l2norm, with a hand-written backward. kq (n, b, h, 2C, K): each chunk's keys
    over its queries; v (b, t, h, V); g, beta (n, b, h, C); h0 (b, h, K, V) or None; same, fresh the document
    masks (or None). Returns o (b, t, h, V) and S_n (not computed unless `need_last`).

    Forward: the small per-chunk factors for all chunks at once (`_factors`), then one loop over chunks for the
    products with the state (`_scan`); backward: the loop in reverse (`_scan_backward`), then the factors'
    gradients (`_factors_backward`). The loops read each chunk's block of every row and head while it is in
    cache (about twice as fast on CPU as products batched over all chunks)."""

    @staticmethod
    def forward(ctx, kq, v, g, beta, h0, same, fresh, scale, need_last, fused):
        f = _factors(kq, g, beta, same, fresh, scale)
        o, states, kqS, u = (_scan_cpu if fused else _scan)(kq, v, f, h0, scale, need_last)
        ctx.save_for_backward(kq, v, beta, states, kqS, u, *f)
        ctx.scale, ctx.zero_start, ctx.need_last, ctx.fused = scale, h0 is None, need_last, fused
        return o, (states[-1].clone() if need_last else states.new_zeros(()))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlast):
        kq, v, beta, states, kqS, u, *f = ctx.saved_tensors
        want_dh0 = not ctx.zero_start and ctx.needs_input_grad[4]
        scan_backward = _scan_backward_cpu if ctx.fused else _scan_backward
        dkq, dv, dlog, dTb, dA, dh0 = scan_backward(ctx, kq, v, f, states, kqS, u, do,
                                                    dlast if ctx.need_last else None, want_dh0)
        dg, dbeta = _factors_backward(ctx.scale, kq, beta, f, dlog, dTb, dA, dkq)
        return dkq, dv, dg, dbeta, dh0, None, None, None, None, None


def _factors(kq: Tensor, g: Tensor, beta: Tensor, same: Tensor | None, fresh: Tensor | None, scale: float):
    """With G the within-chunk cumsum of g (restarting at document starts) and M[i, j] = exp(G_i - G_j) for
    j <= i in one document: eG = exp(G) (decay from the chunk start, 0 once a document started), eGe =
    exp(G_end - G) (decay to the chunk end), a = exp(G_end) (the whole chunk), T = (I + L)^-1 with
    L = diag(beta) (k k^T * M) strictly lower, Tb = T diag(beta), A = (q k^T * M) scale (causal). Returns
    (P = [k k^T; q k^T], M, T, sc (the cumsum's mask; empty without documents), eG, eGe, a, Tb, A)."""
    C = kq.shape[-2] // 2
    P = kq @ kq[..., :C, :].transpose(-1, -2)                                # [k k^T; q k^T] in one product
    causal = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    sc = None if same is None else same * causal
    G = g.cumsum(-1) if sc is None else (sc @ g[..., None]).squeeze(-1)      # no earlier document's gate
    # exp's underflow path (and exp(-inf)) runs ~15x slower than its main one on CPU: clamp at -87, where
    # exp is ~1.6e-38 (the smallest normal float), far below what any sum it enters can resolve
    M = (G[..., :, None] - G[..., None, :]).tril_().clamp_(min=-87.0).exp_().tril_()
    eG, eGe = G.exp(), (G[..., -1:] - G).exp()
    a = eG[..., -1]
    if same is not None:                                                     # a document starts in between:
        M = M * same
        eG, eGe, a = eG * fresh, eGe * same[..., -1, :], a * fresh[..., -1]  # the entering state is dropped
    T = _unit_lower_inverse((P[..., :C, :] * M).mul_(beta[..., :, None]).tril_(-1))
    empty = M.new_zeros(0)                                                   # save_for_backward takes no None
    return P, M, T, (empty if sc is None else sc), eG, eGe, a, T * beta[..., None, :], (P[..., C:, :] * M).mul_(scale)


def _factors_backward(scale, kq, beta, f, dlog, dTb, dA, dkq):
    """Gradients of `_factors` given those of its outputs; dlog = (d eG * eG, d eGe * eGe, d a * a) (each
    factor is exp of a difference of G's, so that product is all the G gradient needs). Adds the keys' and
    queries' part into dkq in place; returns (dg, dbeta). dT = dTb diag(beta); dL = -T^T dT T^T (strictly
    lower); d(k k^T) = beta dL * M; d(q k^T) = scale dA * M; dM * M feeds dG; dg is dG's reverse cumsum."""
    P, M, T, sc, *_ = f
    C = kq.shape[-2] // 2
    KK, QK = P[..., :C, :], P[..., C:, :]
    Tt = T.transpose(-1, -2)
    dbeta = (dTb * T).sum(-2)                                                # Tb = T diag(beta)
    dLM = (Tt @ (dTb * beta[..., None, :]) @ Tt).neg_().tril_(-1).mul_(M)   # dL * M
    dP = torch.empty_like(P)
    torch.mul(dLM, beta[..., :, None], out=dP[..., :C, :])
    torch.mul(dA, M, out=dP[..., C:, :]).mul_(scale)
    E = dLM.mul_(KK)
    dbeta += E.sum(-1)
    E.mul_(beta[..., :, None]).addcmul_(dP[..., C:, :], QK)                  # dM * M
    gG, gGe, ga = dlog
    dG = (E.sum(-1) - E.sum(-2)).add_(gG).sub_(gGe)
    dG[..., -1] += gGe.sum(-1) + ga
    if sc.numel():
        dg = (sc.transpose(-1, -2) @ dG[..., None]).squeeze(-1)
    else:
        dg = dG.flip(-1).cumsum(-1).flip(-1)
    kq3, dkq3, dP3 = (x.flatten(0, -3) for x in (kq, dkq, dP))                # (n b h, rows, cols)
    _add_product(dkq3, dP3, kq3[:, :C])
    # k is also the right factor; not accumulated in the gemm: into a strided view it runs one addmm per matrix
    dkq3[:, :C] += dP3.transpose(-1, -2) @ kq3
    return dg, dbeta


def _add_product(out: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """out += x @ y in one gemm (batched, contiguous out). Not `out.baddbmm_`: FlopCounterMode does not count
    in-place baddbmm, and this path's FLOPs are checked with it."""
    return torch.baddbmm(out, x, y, out=out)


def _chunks(*xs: Tensor) -> list[tuple[Tensor, ...]]:
    """(n, b, h, ...) tensors -> per chunk c, their (b h, ...) views (made once: every index in the loop would
    cost a dispatch). Contiguous (b, h) only."""
    return list(zip(*(x.flatten(1, 2).unbind(0) for x in xs)))


def _scan(kq: Tensor, v: Tensor, f, h0: Tensor | None, scale: float, need_last: bool):
    """Chunks c = 0..n-1 from S_0 = h0 (zero if None), with k, q the chunk's rows of kq:
    z = v - eG * (k S_c);  u = Tb z (the delta-rule writes);  o = A u + scale eG * (q S_c);
    S_{c+1} = a S_c + k^T (eGe * u). Products with a zero state are skipped (the first chunk's without h0), and
    so is the last chunk's state write when S_n is not asked for. Returns (o, states S_0..S_n, kqS = [k S_c;
    q S_c], u)."""
    *_, eG, eGe, a, Tb, A = f
    n, b, h, C2, K = kq.shape
    C, V = C2 // 2, v.shape[-1]
    o = v.new_empty(v.shape)
    states = kq.new_empty(n + 1, b, h, K, V)
    kqS = kq.new_empty(n, b, h, C2, V)
    u = kq.new_empty(n, b, h, C, V)
    states[0] = 0 if h0 is None else h0
    if h0 is None:
        kqS[0] = 0
    S = states.flatten(1, 2)
    per_chunk = _chunks(kq, kq[..., :C, :].transpose(-1, -2), kqS, kqS[..., :C, :], kqS[..., C:, :], u,
                        eG[..., None], eGe[..., None], a[..., None, None], Tb, A)
    vs, os = _chunk_major(v, C).unbind(0), _chunk_major(o, C).unbind(0)   # (b, h, C, V) strided views
    z = kq.new_empty(b * h, C, V)                                            # scratch, one chunk at a time
    for c, (kq_c, kT, kqS_c, kS, qS, u_c, eG_c, eGe_c, a_c, Tb_c, A_c) in enumerate(per_chunk):
        if c or h0 is not None:
            torch.bmm(kq_c, S[c], out=kqS_c)
        torch.addcmul(vs[c], kS.view(b, h, C, V), eG_c.view(b, h, C, 1), value=-1.0, out=z.view(b, h, C, V))
        torch.bmm(Tb_c, z, out=u_c)
        torch.addcmul((A_c @ u_c).view(b, h, C, V), qS.view(b, h, C, V), eG_c.view(b, h, C, 1), value=scale,
                      out=os[c])
        if c < n - 1 or need_last:
            _add_product(torch.mul(S[c], a_c, out=S[c + 1]), kT, u_c * eGe_c)
    return o, states, kqS, u


def _scan_backward(ctx, kq, v, f, states, kqS, u, do, dlast, want_dh0):
    """`_scan` in reverse: du = A^T do + eGe * (k dS_{c+1}); dz = Tb^T du (= dv); d[kS; qS] = [-eG * dz;
    scale eG * do]; d kq = d[kS; qS] S_c^T (+ (eGe * u) dS_{c+1}^T for k); dS_c = a dS_{c+1} + kq^T d[kS; qS].
    Returns (dkq, dv, dlog (see `_factors_backward`), dTb, dA, dh0)."""
    *_, eG, eGe, a, Tb, A = f
    n, b, h, C2, K = kq.shape
    C, V, B = C2 // 2, v.shape[-1], b * h
    dkq, dv = torch.empty_like(kq), torch.empty_like(v)
    dTb, dA, gG = torch.empty_like(Tb), torch.empty_like(A), torch.empty_like(eG)
    gGe, ga = torch.zeros_like(eGe), torch.zeros_like(a)                    # stay 0 where no gradient enters
    dkqS, z = kq.new_empty(B, C2, V), kq.new_empty(B, C, V)                 # scratch, one chunk at a time
    dS = None if dlast is None else dlast.reshape(B, K, V).clone()          # then updated in place
    per_chunk = _chunks(kq, states[:n], kqS, u, eG[..., None], eGe[..., None], a[..., None, None], Tb, A, dkq,
                        dTb, dA, gG, gGe, ga)
    dos, vs, dvs = (_chunk_major(x, C).unbind(0) for x in (torch.zeros_like(v) if do is None else do, v, dv))
    for c in range(n - 1, -1, -1):
        kq_c, S, kqS_c, u_c, eG_c, eGe_c, a_c, Tb_c, A_c, dkq_c, dTb_c, dA_c, gG_c, gGe_c, ga_c = per_chunk[c]
        do_c = dos[c].reshape(B, C, V)                                       # a copy: the chunk is strided
        du = A_c.transpose(-1, -2) @ do_c
        if dS is not None:                                                   # the chunk's write into S_{c+1}
            kdS = kq_c[:, :C] @ dS
            du.addcmul_(kdS, eGe_c)
            ue = u_c * eGe_c
            torch.sum(ue * kdS, -1, out=gGe_c)
            torch.mul(torch.linalg.vecdot(dS.flatten(1), S.flatten(1)), a_c.flatten(), out=ga_c)
        torch.bmm(do_c, u_c.transpose(-1, -2), out=dA_c)
        torch.addcmul(vs[c], kqS_c[:, :C].view(b, h, C, V), eG_c.view(b, h, C, 1), value=-1.0,
                      out=z.view(b, h, C, V))
        torch.bmm(du, z.transpose(-1, -2), out=dTb_c)
        dz = Tb_c.transpose(-1, -2) @ du
        dvs[c].copy_(dz.view(b, h, C, V))
        torch.mul(dz, eG_c, out=dkqS[:, :C]).neg_()
        torch.mul(do_c, eG_c, out=dkqS[:, C:]).mul_(ctx.scale)
        r = (dkqS * kqS_c).sum(-1)                                           # eG * d eG, from both halves
        torch.add(r[:, :C], r[:, C:], out=gG_c)
        if c or not ctx.zero_start:
            torch.bmm(dkqS, S.transpose(-1, -2), out=dkq_c)
        else:
            dkq_c.zero_()
        if dS is not None:
            dkq_c[:, :C] += ue @ dS.transpose(-1, -2)
        if c or want_dh0:
            if dS is None:
                dS = kq_c.transpose(-1, -2) @ dkqS
            else:
                _add_product(dS.mul_(a_c), kq_c.transpose(-1, -2), dkqS)
    return dkq, dv, (gG, gGe, ga), dTb, dA, (dS.view(b, h, K, V) if want_dh0 else None)


def _loop_inputs(v: Tensor, f) -> list[Tensor]:
    """v and the factors the loops read, as the C++ loops take them (unit inner stride; factors contiguous)."""
    *_, eG, eGe, a, Tb, A = f
    return [v if v.stride(-1) == 1 else v.contiguous(), *(x.contiguous() for x in (eG, eGe, a, Tb, A))]


def _scan_cpu(kq: Tensor, v: Tensor, f, h0: Tensor | None, scale: float, need_last: bool):
    """`_scan` on the C++ module (same outputs)."""
    empty = kq.new_zeros(0)
    return scan_cpu.gated_delta_scan(kq, *_loop_inputs(v, f), empty if h0 is None else h0.contiguous(), scale,
                                     need_last)


def _scan_backward_cpu(ctx, kq, v, f, states, kqS, u, do, dlast, want_dh0):
    """`_scan_backward` on the C++ module (same outputs)."""
    do = torch.zeros_like(v) if do is None else (do if do.stride(-1) == 1 else do.contiguous())
    dlast = kq.new_zeros(0) if dlast is None else dlast.contiguous()
    dkq, dv, gG, gGe, ga, dTb, dA, dh0 = scan_cpu.gated_delta_scan_backward(
        kq, *_loop_inputs(v, f), states, kqS, u, do, dlast, ctx.scale, ctx.zero_start, want_dh0)
    return dkq, dv, (gG, gGe, ga), dTb, dA, (dh0 if want_dh0 else None)


class _ChunkedGatedDeltaCPU(torch.autograd.Function):
    """impl "cpu" without document masks: the keys' and queries' l2norm and layout (`_KeysOverQueries`), the
    factors (`_factors`) and the loops (`_scan`) in one C++ pass forward, and the same backward, each chunk's
    work done while its rows are in cache. It saves z = v - eG k S per chunk where `_scan` saves [k S; q S] and u
    (a third of the bytes): the backward makes u = Tb z again and the gate's gradient from d[kS; qS] S^T. k, q
    (b, t, h, K) and v (b, t, h, V) fp32, unit inner stride; g, beta (n, b, h, C) chunk-major. Returns o
    (b, t, h, V) and S_n (not computed unless `need_last`)."""

    @staticmethod
    def forward(ctx, k, q, v, g, beta, h0, C, scale, normalise, need_last):
        empty = k.new_zeros(0)
        o, states, z, kq, rs, *f = scan_cpu.gated_delta_chunk(
            k, q, v, g.contiguous(), beta.contiguous(), empty if h0 is None else h0.contiguous(), C, scale,
            normalise, need_last)
        ctx.save_for_backward(kq, rs, v, beta, states, z, *f)
        ctx.scale, ctx.normalise, ctx.zero_start, ctx.need_last = scale, normalise, h0 is None, need_last
        return o, (states[-1].clone() if need_last else states.new_zeros(()))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dlast):
        kq, rs, v, beta, states, z, *f = ctx.saved_tensors
        want_dh0 = not ctx.zero_start and ctx.needs_input_grad[5]
        do = torch.zeros_like(v) if do is None else (do if do.stride(-1) == 1 else do.contiguous())
        dlast = kq.new_zeros(0) if dlast is None or not ctx.need_last else dlast.contiguous()
        dk, dq, dv, dg, dbeta, dh0 = scan_cpu.gated_delta_chunk_backward(
            kq, rs, v, beta.contiguous(), *f, states, z, do, dlast, ctx.scale, ctx.normalise, ctx.zero_start, want_dh0)
        return dk, dq, dv, dg, dbeta, (dh0 if want_dh0 else None), None, None, None, None


def _unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower-triangular L (..., C, C): one batched unit-triangular solve (LAPACK's trsm
    ignores L's zero diagonal and takes it as 1). Exact forward substitution: no series, no cancellation."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    return torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False, unitriangular=True)


def _document_masks(reset: Tensor | None, b: int, n: int, C: int):
    """same[i, j]: positions i and j of a chunk lie in one document; fresh[i]: no document starts in the chunk
    up to and including i (so the state entering the chunk still counts). Chunk-major, (n, b, 1, C, C) and
    (n, b, 1, C); None, None without resets."""
    if reset is None:
        return None, None
    starts = reset.reshape(b, n, C).transpose(0, 1)[:, :, None].to(torch.float32).cumsum(-1)  # begun so far
    same = (starts[..., :, None] == starts[..., None, :]).to(torch.float32)
    fresh = (starts == 0).to(torch.float32)
    return same, fresh


def _fla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, reset, use_qk_l2norm):
    """fla's chunked kernel; `reset` becomes cu_seqlens over the batch flattened into one sequence."""
    fn = _fla("chunk_gated_delta_rule")
    if reset is None:
        o, last = fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)
        return o, (last.float() if last is not None else None)
    b, t = reset.shape
    first = reset.clone()
    first[:, 0] = True                                                       # every row starts a sequence
    cu = torch.nonzero(first.reshape(-1)).flatten()
    cu = torch.cat([cu, cu.new_tensor([b * t])]).to(torch.int32)
    flat = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, last = fn(*flat, scale=scale, output_final_state=output_final_state, cu_seqlens=cu,
                 use_qk_l2norm_in_kernel=use_qk_l2norm)
    if last is not None:  # the state after each row's last document
        row_last = torch.searchsorted(cu[1:-1].long(), torch.arange(1, b + 1, device=cu.device) * t - 1,
                                      right=True)
        last = last[row_last].float()
    return o.reshape(b, t, *o.shape[2:]), last
