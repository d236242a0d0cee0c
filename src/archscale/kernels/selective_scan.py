"""Mamba-1 selective scan: a readable reference, a fast chunked PyTorch path, and mamba-ssm's CUDA kernel.

Semantics (shapes as mamba-ssm's ``selective_scan_fn``; b = batch, d = d_inner, n = d_state, L = length)::

    dt_t = softplus(delta_t + delta_bias)                  (b, d)         [softplus only if delta_softplus]
    h_t  = exp(dt_t * A) * h_{t-1} + (dt_t * u_t) B_t     (b, d, n)      h_{-1} = initial_state or 0
    y_t  = C_t . h_t + D * u_t                             (b, d)
    y_t *= silu(z_t)                                       if z is given

Everything is computed in fp32; ``y`` comes back in ``u``'s dtype, the last state in fp32.

Implementations (``impl=``):

- ``"ref"``: a plain loop over time with differentiable torch ops; the oracle the others are tested against.
- ``"cpu"``: the CPU default when it builds: a fused C++ loop per channel (``scan_cpu.py``,
  ``csrc/selective_scan_cpu.cpp``), compiled once per machine on first use; 3-5x faster than ``"chunked"``
  forward + backward, because nothing of size steps x d_inner x d_state is written.
- ``"chunked"``: the CPU fallback (no C++ compiler or ``ninja``), and the path for tests of the same maths in
  PyTorch ops. A custom ``autograd.Function`` over time-major tensors. The sequence is
  processed ``BLOCK`` steps at a time (only that block's ``(steps, b, d, n)`` decays and states exist at once;
  just the state entering each block is saved, and backward recomputes the block). Inside a block a two-level
  scan runs: level 1 scans all ``CHUNK``-step chunks at once from a zero state (one in-place ``addcmul`` per
  step, over every chunk), level 2 walks the chunk ends, and one pass adds each chunk's true starting state,
  decayed by ``exp(A * cumsum(dt))``. Backward runs the adjoint recurrence the same way in reverse and forms
  all gradients with batched matmuls. Only decays ``exp(dt*A) <= 1`` and products of them appear, never
  ``exp(-cumsum(dt*A))``, so strong decay (``dt*A`` of -250 per step) underflows harmlessly to 0. ``CHUNK ==
  BLOCK`` is a plain sequential pass (least memory traffic: ~6x less work than mambapy's parallel scan), but
  one tiny op per step; smaller chunks trade ~1.5x more traffic for ~4x fewer ops, which is what keeps it fast
  on 2 shared cores, where every parallel op waits for a busy neighbour (numbers in docs/BENCHMARKS.md).
- ``"cuda"``: ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (needs the ``mamba-ssm`` package
  and CUDA tensors; it has no initial state, so a call with ``initial_state`` falls back to ``"chunked"``).
- ``"auto"`` (default): ``"cuda"`` when mamba-ssm imports and ``u`` is on CUDA; on CPU ``"cpu"`` when the kernel
  builds; else ``"chunked"``.

Environment: ``ARCHSCALE_SCAN_IMPL=ref|chunked|cpu|cuda|auto`` replaces ``impl="auto"`` (what the models pass),
e.g. to force the reference in a debugging run or to keep a GPU run off the CUDA kernel. An explicit ``impl``
other than ``"auto"`` is never overridden, so tests stay deterministic.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from archscale.kernels import scan_cpu as cpu_kernel
from archscale.kernels.dispatch import Dispatch, Impl, cuda_impl

ENV_VAR = "ARCHSCALE_SCAN_IMPL"
CHUNK = 8     # chunked path: steps per chunk (level-1 scan length; tuned in docs/BENCHMARKS.md)
BLOCK = 64    # chunked path: steps whose (steps, b, d, n) workspace is materialised at once

_MAMBA_SSM: dict[str, object] = {}
# the mamba-ssm functions any of our kernels may dispatch to (Mamba-1 here, Mamba-2 in ssd.py): name -> module
MAMBA_SSM_FUNCTIONS = {
    "selective_scan_fn": "mamba_ssm.ops.selective_scan_interface",
    "selective_state_update": "mamba_ssm.ops.triton.selective_state_update",
    "mamba_chunk_scan_combined": "mamba_ssm.ops.triton.ssd_combined",
}


def _mamba_ssm(name: str):
    """A mamba-ssm function (`MAMBA_SSM_FUNCTIONS`), or None when not installed (cached)."""
    if name not in _MAMBA_SSM:
        try:
            fn = getattr(importlib.import_module(MAMBA_SSM_FUNCTIONS[name]), name)
        except Exception:  # ImportError, or a broken CUDA/Triton build raising at import
            fn = None
        _MAMBA_SSM[name] = fn
    return _MAMBA_SSM[name]


def cuda_scan_available() -> bool:
    return torch.cuda.is_available() and _mamba_ssm("selective_scan_fn") is not None


def _cpu_kernel_unavailable(x: Tensor, d_state: int = 0, **_) -> str:
    if d_state > cpu_kernel.MAX_STATE:
        return f"takes d_state up to {cpu_kernel.MAX_STATE} (got {d_state})"  # its stack buffers' size
    if x.is_cuda:
        return "needs CPU tensors"
    if not cpu_kernel.available():
        return f"needs the compiled CPU kernel ({cpu_kernel.unavailable_reason()})"
    return ""


def _has_state_or_resets(initial_state: Tensor | None = None, reset: Tensor | None = None, **_) -> bool:
    return initial_state is not None or reset is not None  # mamba-ssm's kernel takes neither


SCAN = Dispatch("selective_scan", (
    cuda_impl("cuda", lambda: _mamba_ssm("selective_scan_fn"), "mamba-ssm", steps_aside=_has_state_or_resets,
              instead="chunked"),
    Impl("cpu", _cpu_kernel_unavailable),
    Impl("chunked"),
    Impl("ref"),
), env_var=ENV_VAR)
SCAN_IMPLS = SCAN.choices


def runs_cpu_kernel(impl: str, u: Tensor, d_state: int) -> bool:
    """Whether a scan of `u` with this `impl` (after the environment override) runs the C++ CPU kernel, with no
    initial state or resets: where the Mamba layer also takes the kernel's fused conv + silu."""
    return SCAN.resolve(impl, x=u, d_state=d_state) == "cpu"


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   z: Tensor | None = None, delta_bias: Tensor | None = None, delta_softplus: bool = True,
                   initial_state: Tensor | None = None, return_last_state: bool = False, impl: str = "auto",
                   reset: Tensor | None = None):
    """The Mamba-1 selective scan (see the module docstring). Returns y, or (y, last_state) if asked.

    `reset` (batch, L) bool marks the first token of each new document in a packed sequence (variable-length
    training): the state is zeroed before that token, so nothing flows across documents. Exact in every path
    (the decays into a reset step are set to 0, not approximated); mamba-ssm's kernel has no such input, so a
    call with `reset` runs the chunked path, on CUDA too."""
    impl = SCAN.resolve(impl, x=u, d_state=A.shape[-1], initial_state=initial_state, reset=reset)
    if impl == "cuda":
        fn = _mamba_ssm("selective_scan_fn")
        out = fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                 return_last_state=return_last_state)
        if return_last_state:
            y, last = out
            return y, last.float()
        return out

    if impl == "cpu":  # D and the gate fused into the C++ kernel (softplus stays here: torch's is vectorised)
        with torch.autocast(device_type=u.device.type, enabled=False):
            dt = delta.float() if delta_bias is None else delta.float() + delta_bias.float().unsqueeze(-1)
            y, last = cpu_kernel.fused_scan(u, F.softplus(dt) if delta_softplus else dt, A, B, C, D, z,
                                            initial_state, reset)
        y = y.to(u.dtype)
        return (y, last) if return_last_state else y
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
            y, last = _scan_ref(uf, dt, A, B, C, h0, reset)
        else:
            y, last = _scan_chunked(uf, dt, A, B, C, h0, reset)
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

def _scan_ref(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None,
              reset: Tensor | None = None):
    """u, dt: (b, d, L); A: (d, n); B, C: (b, n, L); h0: (b, d, n) or None; reset (b, L) bool or None.
    Returns y (b, d, L), h (b, d, n)."""
    b, d, L = u.shape
    h = h0 if h0 is not None else u.new_zeros(b, d, A.shape[1])
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, :, t, None] * A)                            # (b, d, n)
        if reset is not None:
            decay = decay * (~reset[:, t]).to(decay.dtype)[:, None, None]   # a new document starts from 0
        h = decay * h + (dt[:, :, t] * u[:, :, t])[:, :, None] * B[:, None, :, t]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(b, d, 0)
    return y, h


# --------------------------------------------------------------------------------------------------------------
# Chunked: custom autograd.Function over time-major tensors.

def _scan_chunked(u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None,
                  reset: Tensor | None = None):
    b, d, L = u.shape
    n = A.shape[1]
    if L == 0:
        return _scan_ref(u, dt, A, B, C, h0)
    if h0 is None:
        h0 = u.new_zeros(b, d, n)
    chunk = max(1, min(CHUNK, L))
    block = max(chunk, BLOCK // chunk * chunk)
    pad = -L % chunk
    # time-major: one time step is a contiguous (b, d, n) block of the workspace
    u_t, dt_t = u.permute(2, 0, 1), dt.permute(2, 0, 1)                               # (L, b, d)
    B_t, C_t = B.permute(2, 0, 1), C.permute(2, 0, 1)                                 # (L, b, n)
    keep = None if reset is None else (~reset).to(u.dtype).t()                        # (L, b): 0 at resets
    if pad:  # dt = 0 steps: decay 1, input 0, so the state just carries through; their y is dropped
        u_t, dt_t, B_t, C_t = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (u_t, dt_t, B_t, C_t))
        if keep is not None:
            keep = F.pad(keep, (0, 0, 0, pad), value=1.0)
    y_t, last = _ChunkedScan.apply(u_t.contiguous(), dt_t.contiguous(), A.contiguous(), B_t.contiguous(),
                                   C_t.contiguous(), h0.contiguous(), chunk, block,
                                   None if keep is None else keep.contiguous())
    return y_t[:L].permute(1, 2, 0), last


def _block_states(dt: Tensor, dtu: Tensor, A: Tensor, B: Tensor, h: Tensor, chunk: int,
                  keep: Tensor | None = None):
    """All states of one block, by a two-level scan. dt, dtu: (T, b, d) with T % chunk == 0; B: (T, b, n);
    h: the state before the block (b, d, n); keep (T, b): 0 where a document starts (decay forced to 0), or None.

    Returns (H, decay, cum, resets): H[t] = decay[t] * H[t-1] + dtu[t] B[t] (H[-1] := h), decay = exp(dt*A)
    (x keep), both (T, b, d, n); cum (T/chunk, chunk, b, d) = within-chunk inclusive cumsum of dt; resets
    (T/chunk, chunk, b) = within-chunk inclusive count of document starts (None without `keep`): a product of
    decays over a span is exp(A * sum dt) when the span holds no start, and exactly 0 when it does.

    Level 1 runs the recurrence inside every chunk at once from a zero state (`chunk` steps, each one op over
    all chunks); level 2 walks the chunk ends (T/chunk steps) to get the true state entering each chunk; a last
    pass adds that state, decayed by exp(A * cumsum(dt)) <= 1, to every position of its chunk.
    """
    T, b, d = dt.shape
    n = A.shape[1]
    nc = T // chunk
    decay = torch.mul(dt.unsqueeze(-1), A).exp_()               # exp(dt*A) in (0, 1]: nothing can overflow
    if keep is not None:
        decay.mul_(keep[:, :, None, None])
    H = dtu.unsqueeze(-1) * B.unsqueeze(2)
    if nc == 1:  # one chunk: a plain sequential pass from h (less memory traffic, one op per step)
        H[0].addcmul_(decay[0], h)
        for t in range(1, T):
            H[t].addcmul_(decay[t], H[t - 1])
        return H, decay, None, None
    Hc, Dc = H.view(nc, chunk, b, d, n), decay.view(nc, chunk, b, d, n)
    for s in range(1, chunk):
        Hc[:, s].addcmul_(Dc[:, s], Hc[:, s - 1])
    cum = dt.view(nc, chunk, b, d).cumsum(1)
    P = torch.mul(cum.unsqueeze(-1), A).exp_()                  # decay from the chunk start through step s
    resets = None
    if keep is not None:
        resets = (1.0 - keep).view(nc, chunk, b).cumsum(1)
        P.mul_((resets == 0).to(P.dtype)[..., None, None])      # a document start in between: no carry
    starts = [h]
    for c in range(nc - 1):
        starts.append(torch.addcmul(Hc[c, -1], P[c, -1], starts[-1]))
    Hc.addcmul_(P, torch.stack(starts).unsqueeze(1))
    return H, decay, cum, resets


class _ChunkedScan(torch.autograd.Function):
    """y (T, b, d), last (b, d, n) from u, dt (T, b, d), A (d, n), B, C (T, b, n), h0 (b, d, n); all fp32.

    T is a multiple of `chunk`; the sequence is processed `block` steps at a time so the (block, b, d, n)
    workspace bounds memory; only the state entering each block is saved for backward, which recomputes.
    """

    @staticmethod
    def forward(ctx, u, dt, A, B, C, h0, chunk, block, keep):
        T, b, d = u.shape
        n = A.shape[1]
        y = u.new_empty(T, b, d)
        dtu = dt * u
        h = h0
        starts = []
        for s in range(0, T, block):
            e = min(s + block, T)
            starts.append(h)
            H, _, _, _ = _block_states(dt[s:e], dtu[s:e], A, B[s:e], h, chunk,
                                       None if keep is None else keep[s:e])
            # y[t, b, d] = sum_n H[t, b, d, n] C[t, b, n]
            y[s:e] = torch.bmm(H.view(-1, d, n), C[s:e].reshape(-1, n, 1)).view(e - s, b, d)
            h = H[-1].clone()
        ctx.save_for_backward(u, dt, A, B, C, torch.stack(starts))
        ctx.chunk, ctx.block, ctx.keep = chunk, block, keep
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, glast):
        u, dt, A, B, C, starts = ctx.saved_tensors
        chunk, block, keep = ctx.chunk, ctx.block, ctx.keep
        T, b, d = u.shape
        n = A.shape[1]
        with torch.autocast(device_type=u.device.type, enabled=False):
            gy = gy.contiguous() if gy is not None else u.new_zeros(T, b, d)
            carry = glast.contiguous() if glast is not None else u.new_zeros(b, d, n)  # dLoss/d(state at block end)
            dtu = dt * u
            gu, gdt = torch.empty_like(u), torch.empty_like(dt)
            gB, gC = torch.empty_like(B), torch.empty_like(C)
            gA = torch.zeros_like(A)
            for k in range(starts.shape[0] - 1, -1, -1):
                s = k * block
                e = min(s + block, T)
                q, nc = e - s, (e - s) // chunk
                h_start = starts[k]
                H, decay, cum, resets = _block_states(dt[s:e], dtu[s:e], A, B[s:e], h_start, chunk,
                                                      None if keep is None else keep[s:e])
                gyc = gy[s:e]
                # dC[t, b, n] = sum_d gy[t, b, d] H[t, b, d, n]
                gC[s:e] = torch.bmm(gyc.reshape(q * b, 1, d), H.view(q * b, d, n)).view(q, b, n)
                # adjoint recurrence G[t] = gy[t] C[t] + decay[t+1] G[t+1] (G[q-1] also gets the carry), two-level
                G = gyc.unsqueeze(-1) * C[s:e].unsqueeze(2)             # (q, b, d, n)
                if nc == 1:
                    G[-1].add_(carry)
                Gc, Dc = G.view(nc, chunk, b, d, n), decay.view(nc, chunk, b, d, n)
                for t in range(chunk - 2, -1, -1):                     # level 1: inside chunks (zero carry-in)
                    Gc[:, t].addcmul_(Dc[:, t + 1], Gc[:, t + 1])
                if nc > 1:
                    # R[c, t] = prod_{r=t+1}^{chunk-1} decay[c, r] = exp(A * (cum[c, -1] - cum[c, t])) <= 1
                    R = torch.mul((cum[:, -1:] - cum).unsqueeze(-1), A).exp_()
                    if resets is not None:                               # a start in (t, chunk-1]: R = 0
                        R.mul_((resets[:, -1:] == resets).to(R.dtype)[..., None, None])
                    g_in = [carry]                                       # level 2: dLoss/d(state at chunk end)
                    for c in range(nc - 1, 0, -1):
                        g_in.append(Dc[c, 0] * torch.addcmul(Gc[c, 0], R[c, 0], g_in[-1]))
                    Gc.addcmul_(R, torch.stack(g_in[::-1]).unsqueeze(1))
                carry = decay[0] * G[0]                                  # dLoss/d(state entering this block)
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
        return gu, gdt, gA, gB, gC, carry, None, None, None
