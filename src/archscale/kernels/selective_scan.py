"""Mamba-1 selective scan: a readable reference, a fast chunked PyTorch path, and mamba-ssm's CUDA kernel.

Semantics (shapes as mamba-ssm's ``selective_scan_fn``; b = batch, d = d_inner, n = d_state, L = length)::

    dt_t = softplus(delta_t + delta_bias)                  (b, d)         [softplus only if delta_softplus]
    h_t  = exp(dt_t * A) * h_{t-1} + (dt_t * u_t) B_t     (b, d, n)      h_{-1} = initial_state or 0
    y_t  = C_t . h_t + D * u_t                             (b, d)
    y_t *= silu(z_t)                                       if z is given

Everything is computed in fp32; ``y`` comes back in ``u``'s dtype, the last state in fp32.

Implementations (``impl=``):

- ``"ref"``: a plain loop over time with differentiable torch ops; the oracle the others are tested against.
- ``"chunked"``: the CPU default. A custom ``autograd.Function`` that walks the sequence in chunks of
  ``CHUNK`` steps. Per chunk it materialises the decays ``exp(dt*A)`` and the states for that chunk only
  (``(chunk, b, d, n)``, time-major so each step is one contiguous in-place ``addcmul``), reads ``y`` out with a
  batched matmul against ``C`` and keeps just the state entering the chunk. The backward pass recomputes a
  chunk's states from that saved state and runs the adjoint recurrence backwards through it. Only decays
  ``exp(dt*A) <= 1`` and their products are ever formed, never ``exp(-cumsum)``, so a strong decay
  (``dt*A`` of -100 per step) underflows harmlessly to 0 instead of overflowing. Memory: O(b*d*n*chunk) for
  the workspace plus O(b*d*n*L/chunk) saved states, instead of the O(b*d*n*L) an autograd graph of the loop
  (or a parallel scan) keeps alive.
- ``"cuda"``: ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (needs the ``mamba-ssm`` package
  and CUDA tensors; it has no initial state, so a call with ``initial_state`` falls back to ``"chunked"``).
- ``"auto"`` (default): ``"cuda"`` when mamba-ssm imports and ``u`` is on CUDA, else ``"chunked"``.

Environment: ``ARCHSCALE_SCAN_IMPL=ref|chunked|cuda|auto`` replaces ``impl="auto"`` (what the models pass),
e.g. to force the reference in a debugging run or to keep a GPU run off the CUDA kernel. An explicit ``impl``
other than ``"auto"`` is never overridden, so tests stay deterministic.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

SCAN_IMPLS = ("auto", "ref", "chunked", "cuda")
ENV_VAR = "ARCHSCALE_SCAN_IMPL"
CHUNK = 64  # steps per chunk of the chunked path (see benchmarks/mamba_throughput.py and docs/BENCHMARKS.md)

_MAMBA_SSM: dict[str, object] = {}


def _mamba_ssm(name: str):
    """mamba-ssm's `selective_scan_fn` / `selective_state_update`, or None when not installed (cached)."""
    if name not in _MAMBA_SSM:
        fn = None
        try:
            if name == "selective_scan_fn":
                from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as fn
            else:
                from mamba_ssm.ops.triton.selective_state_update import selective_state_update as fn
        except Exception:  # ImportError, or a broken CUDA build raising at import
            fn = None
        _MAMBA_SSM[name] = fn
    return _MAMBA_SSM[name]


def cuda_scan_available() -> bool:
    return torch.cuda.is_available() and _mamba_ssm("selective_scan_fn") is not None


def _resolve_impl(impl: str, u: Tensor, initial_state: Tensor | None) -> str:
    if impl not in SCAN_IMPLS:
        raise ValueError(f"selective_scan: unknown impl {impl!r}; choose one of {', '.join(SCAN_IMPLS)}")
    if impl == "auto":
        forced = os.environ.get(ENV_VAR, "").strip()
        if forced:
            if forced not in SCAN_IMPLS:
                raise ValueError(f"{ENV_VAR}={forced!r} is not a scan implementation; "
                                 f"choose one of {', '.join(SCAN_IMPLS)}")
            impl = forced
    if impl == "auto":
        impl = "cuda" if u.is_cuda and cuda_scan_available() else "chunked"
    if impl == "cuda":
        if not u.is_cuda or _mamba_ssm("selective_scan_fn") is None:
            raise ValueError("selective_scan: impl='cuda' needs the mamba-ssm package and CUDA tensors "
                             "(use impl='chunked' or 'auto')")
        if initial_state is not None:
            impl = "chunked"  # mamba-ssm's kernel cannot start from a given state
    return impl


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = True,
                   initial_state: Tensor | None = None, return_last_state: bool = False, impl: str = "auto"):
    """The Mamba-1 selective scan (see the module docstring). Returns y, or (y, last_state) if asked."""
    impl = _resolve_impl(impl, u, initial_state)
    if impl == "cuda":
        fn = _mamba_ssm("selective_scan_fn")
        out = fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                 return_last_state=return_last_state)
        if return_last_state:
            y, last = out
            return y, last.float()
        return out

    with torch.autocast(device_type=u.device.type, enabled=False):
        uf = u.float()
        dt = delta.float()
        if delta_bias is not None:
            dt = dt + delta_bias.float().unsqueeze(-1)
        if delta_softplus:
            dt = F.softplus(dt)
        A, B, C = A.float(), B.float(), C.float()
        h0 = None if initial_state is None else initial_state.float()
        if impl == "ref":
            y, last = _scan_ref(uf, dt, A, B, C, h0)
        else:
            y, last = _scan_chunked(uf, dt, A, B, C, h0)
        if D is not None:
            y = y + D.float().unsqueeze(-1) * uf
        if z is not None:
            y = y * F.silu(z.float())
    y = y.to(u.dtype)
    return (y, last) if return_last_state else y


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None = None, z: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_softplus: bool = True) -> Tensor:
    """One decoding step of the scan. state (b, d, n) fp32 is updated in place; x, dt, z: (b, d); B, C: (b, n).

    Returns y (b, d) in x's dtype. Uses mamba-ssm's Triton kernel on CUDA when it is installed.
    """
    fn = _mamba_ssm("selective_state_update") if state.is_cuda else None
    if fn is not None:
        return fn(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)
    with torch.autocast(device_type=x.device.type, enabled=False):
        xf, dtf = x.float(), dt.float()
        if dt_bias is not None:
            dtf = dtf + dt_bias.float()
        if dt_softplus:
            dtf = F.softplus(dtf)
        decay = torch.exp(dtf.unsqueeze(-1) * A.float())                    # (b, d, n)
        new = decay * state + (dtf * xf).unsqueeze(-1) * B.float().unsqueeze(1)
        state.copy_(new)
        y = (new * C.float().unsqueeze(1)).sum(-1)                          # (b, d)
        if D is not None:
            y = y + D.float() * xf
        if z is not None:
            y = y * F.silu(z.float())
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# Reference: one step at a time, exactly the recurrence. Differentiable through autograd.

def _scan_ref(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None):
    """u, dt: (b, d, L); A: (d, n); B, C: (b, n, L); h0: (b, d, n) or None. Returns y (b, d, L), h (b, d, n)."""
    b, d, L = u.shape
    h = h0 if h0 is not None else u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, :, t, None] * A)                            # (b, d, n)
        h = decay * h + (dt[:, :, t] * u[:, :, t])[:, :, None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(b, d, 0)
    return y, h


# --------------------------------------------------------------------------------------------------------------
# Chunked: custom autograd.Function over time-major tensors.

def _scan_chunked(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None):
    b, d, L = u.shape
    n = A.shape[1]
    if L == 0:
        return _scan_ref(u, dt, A, B, C, h0)
    if h0 is None:
        h0 = u.new_zeros(b, d, n)
    # time-major: one time step is a contiguous (b, d, n) block in the chunk workspace
    u_t, dt_t = u.permute(2, 0, 1).contiguous(), dt.permute(2, 0, 1).contiguous()     # (L, b, d)
    B_t, C_t = B.permute(2, 0, 1).contiguous(), C.permute(2, 0, 1).contiguous()       # (L, b, n)
    y_t, last = _ChunkedScan.apply(u_t, dt_t, A.contiguous(), B_t, C_t, h0.contiguous())
    return y_t.permute(1, 2, 0), last


def _chunk_states(dt: Tensor, dtu: Tensor, A: Tensor, B: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """States of one chunk. dt, dtu: (q, b, d); B: (q, b, n); h: state before the chunk (b, d, n).

    Returns (H, decay), both (q, b, d, n): H[t] = decay[t] * H[t-1] + dtu[t] B[t], H[-1] := h.
    """
    decay = torch.mul(dt.unsqueeze(-1), A).exp_()               # exp(dt*A) in (0, 1]: no overflow possible
    H = dtu.unsqueeze(-1) * B.unsqueeze(2)
    H[0].addcmul_(decay[0], h)
    for t in range(1, H.shape[0]):
        H[t].addcmul_(decay[t], H[t - 1])
    return H, decay


class _ChunkedScan(torch.autograd.Function):
    """y (L, b, d), last (b, d, n) from u, dt (L, b, d), A (d, n), B, C (L, b, n), h0 (b, d, n); all fp32."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, h0):
        L, b, d = u.shape
        n = A.shape[1]
        chunk = max(1, CHUNK)
        y = u.new_empty(L, b, d)
        dtu = dt * u
        h = h0
        starts = []
        for s in range(0, L, chunk):
            e = min(s + chunk, L)
            q = e - s
            starts.append(h)
            H, _ = _chunk_states(dt[s:e], dtu[s:e], A, B[s:e], h)
            # y[t, b, d] = sum_n H[t, b, d, n] C[t, b, n]
            y[s:e] = torch.bmm(H.view(q * b, d, n), C[s:e].reshape(q * b, n, 1)).view(q, b, d)
            h = H[-1].clone()
        ctx.save_for_backward(u, dt, A, B, C, torch.stack(starts))
        ctx.chunk = chunk
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, glast):
        u, dt, A, B, C, starts = ctx.saved_tensors
        chunk = ctx.chunk
        L, b, d = u.shape
        n = A.shape[1]
        with torch.autocast(device_type=u.device.type, enabled=False):
            gy = gy.contiguous() if gy is not None else u.new_zeros(L, b, d)
            carry = glast.contiguous() if glast is not None else u.new_zeros(b, d, n)  # dLoss/dH[end of chunk]
            dtu = dt * u
            gu, gdt = torch.empty_like(u), torch.empty_like(dt)
            gB, gC = torch.empty_like(B), torch.empty_like(C)
            gA = torch.zeros_like(A)
            n_chunks = starts.shape[0]
            for c in range(n_chunks - 1, -1, -1):
                s = c * chunk
                e = min(s + chunk, L)
                q = e - s
                h_start = starts[c]
                H, decay = _chunk_states(dt[s:e], dtu[s:e], A, B[s:e], h_start)
                Hf = H.view(q * b, d, n)
                gyc = gy[s:e]
                # dC[t, b, n] = sum_d gy[t, b, d] H[t, b, d, n]
                gC[s:e] = torch.bmm(gyc.reshape(q * b, 1, d), Hf).view(q, b, n)
                # adjoint recurrence: G[t] = gy[t] C[t] + decay[t+1] G[t+1];  G[q-1] also gets the carry
                G = gyc.unsqueeze(-1) * C[s:e].unsqueeze(2)             # (q, b, d, n)
                G[-1].add_(carry)
                for t in range(q - 2, -1, -1):
                    G[t].addcmul_(decay[t + 1], G[t + 1])
                carry = decay[0] * G[0]                                  # dLoss/d(state entering this chunk)
                # dLoss/d(dt*A)[t] = G[t] * decay[t] * H[t-1]  (computed in place in `decay`)
                decay[1:].mul_(H[:-1])
                decay[0].mul_(h_start)
                glog = decay.mul_(G)
                gdt_c = (glog * A).sum(-1)                               # (q, b, d)
                gA.add_(torch.einsum("qbdn,qbd->dn", glog, dt[s:e]))
                # through the input term dtu[t] B[t]
                Gf = G.view(q * b, d, n)
                gxb = torch.bmm(Gf, B[s:e].reshape(q * b, n, 1)).view(q, b, d)   # sum_n G B
                gB[s:e] = torch.bmm(dtu[s:e].reshape(q * b, 1, d), Gf).view(q, b, n)
                gu[s:e] = gxb * dt[s:e]
                gdt[s:e] = gdt_c.addcmul_(gxb, u[s:e])
        return gu, gdt, gA, gB, gC, carry
