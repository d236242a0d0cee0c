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
  unit-lower-triangular system (I + L) u = beta v - beta exp(G) k S_0 with L[i, j] = beta_i (k_i . k_j) M[i, j],
  j < i. With Tinv = (I + L)^-1 (one small triangular solve per chunk): U = Tinv (beta v), W = Tinv (beta
  exp(G) k), so u = U - W S_0 for whatever state S_0 enters the chunk (-W is what is stored: the sign, beta, the
  decays and the scale all fold into the small (C, C) factors). Only that product and the state update
  S_C = exp(G_C) S_0 + (exp(G_C - G) k)^T u are sequential over chunks; the outputs
  o = (exp(G) q) S_0 + ((q k^T) * M) u are batched matmuls over all chunks after the loop. Every exp is of a
  non-positive number, so strong decay underflows harmlessly to 0. Autograd differentiates it.
- ``"fla"``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (flash-linear-attention, CUDA tensors). With
  `reset` the batch is flattened into one sequence with ``cu_seqlens`` (fla's varlen form); a call with both
  `reset` and `initial_state` falls back to ``"chunked"``.
- ``"auto"`` (default): ``"fla"`` when fla imports and q is on CUDA, else ``"chunked"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLS = ("auto", "ref", "chunked", "fla")
CHUNK = 64  # chunked path: steps per chunk (fla's and transformers' choice; see benchmarks/gdn_throughput.py)

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


def _resolve_impl(impl: str, q: Tensor, initial_state: Tensor | None, reset: Tensor | None) -> str:
    if impl not in IMPLS:
        raise ValueError(f"gated_delta_rule: unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = "fla" if q.is_cuda and fla_available() else "chunked"
    if impl == "fla":
        if not q.is_cuda or _fla("chunk_gated_delta_rule") is None:
            raise ValueError("gated_delta_rule: impl='fla' needs flash-linear-attention and CUDA tensors")
        if reset is not None and initial_state is not None:
            impl = "chunked"  # fla's varlen form takes one initial state per document, not per row
    return impl


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                     initial_state: Tensor | None = None, output_final_state: bool = False,
                     reset: Tensor | None = None, use_qk_l2norm: bool = True, impl: str = "auto",
                     chunk_size: int = CHUNK) -> tuple[Tensor, Tensor | None]:
    """q, k (b, t, h, K); v (b, t, h, V); g, beta (b, t, h); initial_state (b, h, K, V) or None;
    reset (b, t) bool or None. Returns (o (b, t, h, V) in v's dtype, final state (b, h, K, V) fp32 or None)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    impl = _resolve_impl(impl, q, initial_state, reset)
    if impl == "fla":
        return _fla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, reset, use_qk_l2norm)
    with torch.autocast(device_type=q.device.type, enabled=False):
        h0 = None if initial_state is None else initial_state.float()
        gb = [x.float().transpose(1, 2) for x in (g, beta)]                  # (b, h, t)
        if impl == "ref":
            qf, kf = q.float(), k.float()
            if use_qk_l2norm:
                qf, kf = l2norm(qf), l2norm(kf)
            qkv = [x.transpose(1, 2) for x in (qf * scale, kf, v.float())]   # (b, h, t, ...)
            o, last = _recurrence_ref(*qkv, *gb, h0, reset)
        else:
            qkv = [_heads_first(x, use_qk_l2norm) for x in (q, k)] + [v.float().transpose(1, 2).contiguous()]
            o, last = _chunked(*qkv, *gb, h0, reset, chunk_size, scale)
    return o.transpose(1, 2).to(v.dtype), (last if output_final_state else None)


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
# Chunked: the UT transform inside chunks, the state passed between chunks.

def _heads_first(x: Tensor, normalise: bool) -> Tensor:
    """(b, t, h, D) -> contiguous fp32 (b, h, t, D), l2-normalised over D if asked (one fused pass each way)."""
    if normalise:
        return _L2NormHeadsFirst.apply(x)
    return x.float().transpose(1, 2).contiguous()


class _L2NormHeadsFirst(torch.autograd.Function):
    """y = x rsqrt(sum x^2 + 1e-6), written heads-first; backward dx = r (dy - y (y . dy))."""

    @staticmethod
    def forward(ctx, x):
        xf = x.float()
        r = torch.rsqrt((xf * xf).sum(-1, keepdim=True).add_(1e-6))         # (b, t, h, 1)
        y = torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=torch.float32, device=x.device)
        torch.mul(xf.transpose(1, 2), r.transpose(1, 2), out=y)
        ctx.save_for_backward(y, r)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        y, r = ctx.saved_tensors
        dot = (y * dy).sum(-1, keepdim=True)                                 # (b, h, t, 1)
        g = torch.addcmul(dy, y, dot, value=-1.0).mul_(r.transpose(1, 2))
        return g.transpose(1, 2).to(ctx.in_dtype)


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: Tensor | None,
             reset: Tensor | None, chunk: int, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """Shapes as `_recurrence_ref`, but q not yet scaled (`scale` folds into the small decay factors). Pads t to
    a multiple of `chunk` with g = 0, beta = 0, k = q = 0 steps (decay 1, no write), so the state carries through
    the padding unchanged."""
    b, h, t, K = k.shape
    V = v.shape[-1]
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"gated_delta_rule: chunk_size must be a power of two (got {chunk})")
    if t == 0:
        return v.new_zeros(v.shape), (h0 if h0 is not None else k.new_zeros(b, h, K, V))
    C = min(chunk, 1 << (t - 1).bit_length())                                # a short input: one chunk
    pad = -t % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if reset is not None:
            reset = F.pad(reset, (0, pad), value=False)
    n = (t + pad) // C
    q, k, v = (x.reshape(b, h, n, C, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(b, h, n, C)
    same, fresh = _document_masks(reset, b, n, C)                           # (b, 1, n, C, C), (b, 1, n, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if same is None:
        G = g.reshape(b, h, n, C).cumsum(-1)                                 # log decay from chunk start
    else:  # the sum restarts at each document start: no gate of an earlier document enters, not even rounded
        G = ((same * causal) @ g.reshape(b, h, n, C, 1)).squeeze(-1)
    M = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # (b, h, n, C, C)
    if same is not None:
        M = M * same
    eG = G.exp()                                                             # decay from the chunk start
    eG_end = (G[..., -1:] - G).exp()                                         # decay to the chunk end
    a_end = eG[..., -1]                                                      # whole-chunk decay (b, h, n)
    if fresh is not None:                                                    # a document starts in between:
        eG = eG * fresh                                                      # the entering state is dropped
        eG_end = eG_end * same[..., -1, :]
        a_end = a_end * fresh[..., -1]
    # beta and the decays scale rows / columns of the small (C, C) matrices, not the (C, K) / (C, V) tensors
    kT = k.transpose(-1, -2)
    Tinv = _unit_lower_inverse((beta[..., :, None] * (k @ kT)) * M.tril(-1))  # (I + L)^-1, L strictly lower
    U = (Tinv * beta[..., None, :]) @ v                                      # Tinv (beta v)
    W = (Tinv * -(beta * eG)[..., None, :]) @ k                              # -Tinv (beta exp(G) k): u = U + W S_0
    A = (q @ kT) * (M * scale)                                               # (b, h, n, C, C), causal
    Qe = q * (eG * scale)[..., None]                                         # reads the entering state
    kd = (k * eG_end[..., None]).transpose(-1, -2)                          # (b, h, n, K, C): writes the next
    S = h0 if h0 is not None else q.new_zeros(b, h, K, V)
    o, S = _StatePass.apply(U, W, Qe, A, kd, a_end, S)                      # (b, h, n, C, V), (b, h, K, V)
    return o.reshape(b, h, n * C, V)[:, :, :t], S


class _StatePass(torch.autograd.Function):
    """The sequential part of the chunked form, with a hand-written backward (autograd's would add a
    full-size gradient buffer per chunk).

    For chunks c = 0..n-1 from S_0 = h0:  u_c = U_c + W_c S_c;  o_c = A_c u_c + Qe_c S_c;
    S_{c+1} = a_c S_c + kd_c u_c.  Shapes: U (b, h, n, C, V), W, Qe (b, h, n, C, K), A (b, h, n, C, C),
    kd (b, h, n, K, C), a (b, h, n), h0 (b, h, K, V). Returns o (b, h, n, C, V) and S_n.

    Backward, chunk by chunk from the last: du_c = A_c^T do_c + kd_c^T dS_{c+1};
    dS_c = a_c dS_{c+1} + Qe_c^T do_c + W_c^T du_c; and the gradients of the chunk's factors from the same
    operands. Every product is made inside the loop, on the state just computed: on CPU, (b h) products per chunk
    with S hot in cache run about twice as fast as one product batched over all chunks that streams the stacked
    states (measured with benchmarks/gdn_throughput.py). The states are written chunk-major, in place.
    """

    @staticmethod
    def forward(ctx, U, W, Qe, A, kd, a, h0):
        b, h, n, C, V = U.shape
        WQ = torch.cat([W, Qe], dim=-2).movedim(2, 0).contiguous()          # (n, b, h, 2C, K): one product with S
        kd = kd.movedim(2, 0).contiguous()                                   # (n, b, h, K, C): row-major per chunk
        states = U.new_empty(n + 1, b, h, *h0.shape[-2:])                   # S_0 .. S_n, chunk-major
        u = U.new_empty(n, b, h, C, V)
        o = U.new_empty(b, h, n, C, V)
        states[0].copy_(h0)
        for c in range(n):
            S = states[c]
            ws = WQ[c] @ S                                                   # (b, h, 2C, V): W_c S_c over Qe_c S_c
            torch.add(U[:, :, c], ws[..., :C, :], out=u[c])
            o[:, :, c] = torch.baddbmm(ws[..., C:, :].flatten(0, 1), A[:, :, c].flatten(0, 1),
                                       u[c].flatten(0, 1)).view(b, h, C, V)
            torch.matmul(kd[c], u[c], out=states[c + 1]).addcmul_(S, a[:, :, c, None, None])
        ctx.save_for_backward(WQ, A, kd, a, states, u)
        return o, states[n].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS_last):
        WQ, A, kd, a, states, u = ctx.saved_tensors
        n, b, h, C2, K = WQ.shape
        C = C2 // 2
        dudo = u.new_empty(n, b, h, 2 * C, u.shape[-1])                     # [du_c; do_c], chunk-major
        if do is None:
            dudo[:, :, :, C:].zero_()
        du = dudo[:, :, :, :C]
        dWQ = torch.empty_like(WQ)
        dA = A.new_empty(n, b, h, C, C)
        dkd = torch.empty_like(kd)
        da = a.new_empty(n, b, h)
        dS = dS_last.clone() if dS_last is not None else torch.zeros_like(states[0])
        scratch = torch.empty_like(dS)
        for c in range(n - 1, -1, -1):
            S, do_c, u_c = states[c], dudo[c, :, :, C:], u[c]
            if do is not None:
                do_c.copy_(do[:, :, c])
            torch.matmul(A[:, :, c].transpose(-1, -2), do_c, out=du[c]).add_(kd[c].transpose(-1, -2) @ dS)
            torch.matmul(dS, u_c.transpose(-1, -2), out=dkd[c])
            torch.sum(torch.mul(dS, S, out=scratch), (-1, -2), out=da[c])
            torch.matmul(dudo[c], S.transpose(-1, -2), out=dWQ[c])           # dW_c over dQe_c
            torch.matmul(do_c, u_c.transpose(-1, -2), out=dA[c])
            dS = torch.matmul(WQ[c].transpose(-1, -2), dudo[c]).addcmul_(dS, a[:, :, c, None, None])
        dWQ = dWQ.movedim(0, 2)
        return (du.movedim(0, 2), dWQ[..., :C, :], dWQ[..., C:, :], dA.movedim(0, 2), dkd.movedim(0, 2),
                da.movedim(0, 2), dS)


def _unit_lower_inverse(L: Tensor) -> Tensor:
    """(I + L)^-1 for strictly lower-triangular L (..., C, C), by block forward substitution in matmuls:
    inv([[A, 0], [X, B]]) = [[A^-1, 0], [-B^-1 X A^-1, B^-1]], doubling the block size from 1 (C / 2^j
    independent blocks per level, all at once). Exact like a triangular solve (no series, no cancellation);
    torch.linalg.solve_triangular is several times slower on CPU for these many small systems."""
    C = L.shape[-1]
    lead = L.shape[:-2]
    size = 1
    inv = torch.ones(*lead, C, 1, 1, dtype=L.dtype, device=L.device)        # the 1x1 diagonal blocks
    while size < C:
        if C % (2 * size):
            raise ValueError(f"chunk size {C} must be a power of two")
        m = C // (2 * size)
        blocks = L.reshape(*lead, m, 2 * size, m, 2 * size).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        X = blocks[..., size:, :size]                                        # (..., m, s, s)
        inv = inv.reshape(*lead, m, 2, size, size)
        A_inv, B_inv = inv[..., 0, :, :], inv[..., 1, :, :]
        low = -(B_inv @ X @ A_inv)
        top = torch.cat([A_inv, torch.zeros_like(A_inv)], dim=-1)
        inv = torch.cat([top, torch.cat([low, B_inv], dim=-1)], dim=-2)      # (..., m, 2s, 2s)
        size *= 2
    return inv.reshape(*lead, C, C)


def _document_masks(reset: Tensor | None, b: int, n: int, C: int):
    """same[i, j]: positions i and j of a chunk lie in one document; fresh[i]: no document starts in the chunk
    up to and including i (so the state entering the chunk still counts). None, None without resets."""
    if reset is None:
        return None, None
    starts = reset.reshape(b, 1, n, C).to(torch.float32).cumsum(-1)           # documents begun so far
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
