"""Mamba-2's state-space duality (SSD) scan: a sequential reference, a chunked PyTorch path, mamba-ssm on CUDA.

Semantics (shapes as mamba-ssm's ``mamba_chunk_scan_combined``; b = batch, L = length, h = heads, p = head dim,
g = groups of heads sharing B and C, n = d_state; head i reads group i // (h / g))::

    dt_t = softplus(dt_t + dt_bias)                         (b, h)        [softplus only if dt_softplus]
    H_t  = exp(dt_t * A) * H_{t-1} + dt_t * x_t B_t^T      (b, h, p, n)  H_{-1} = initial_state or 0
    y_t  = H_t C_t + D * x_t                               (b, h, p)

A is one negative scalar per head, so the decay of a head is the same for all of its p x n state entries. That
is what makes the chunked form cheap: inside a chunk of Q steps the map x -> y is a masked "attention"
``y_l = sum_{s<=l} (C_l . B_s) exp(Acum_l - Acum_s) dt_s x_s`` (Acum the within-chunk cumulative sum of dt*A),
and chunks talk only through one state each (the block decomposition of the SSD paper, Dao & Gu 2024).

Documents (variable-length training): ``seq_idx`` (b, L) labels the document of every token (ArchScale passes
the cumulative count of EOS tokens); wherever the label changes the state restarts from zero, exactly (the
decays across a document start are set to 0, not approximated). An ``initial_state`` continues the document of
token 0.

Implementations (``impl=``):

- ``"ref"``: a loop over time with differentiable torch ops; the oracle the others are tested against.
- ``"cpu"`` (the CPU default): the same block decomposition as one C++ kernel with a hand-written backward
  (``csrc/ssd_cpu.cpp``, built with Mamba-1's scan by `kernels/scan_cpu.py`). One task per batch row and group
  of heads walks its chunks in order with the chunk's blocks in cache: per head the (Q, Q) decays and the
  intra-chunk product, and for the whole group (B and C are shared by its heads) the products with B, C and the
  states as one gemm each, through the BLAS torch links; none of the torch path's elementwise passes over
  (batch, length, heads, ...) tensors is made, and it keeps only the state entering each chunk and C B^T per
  chunk for its backward. The last chunk may be shorter (nothing is padded). Falls back to ``"chunked"`` (with
  one warning) where the module cannot be built.
- ``"chunked"``: the block decomposition in batched matmuls (the CPU path without the C++ module): per chunk,
  C B^T and the masked decays ``exp(Acum_l - Acum_s)`` (only exponents <= 0 are ever formed, so strong decay
  underflows to 0 instead of overflowing), the intra-chunk product, each chunk's final state from a zero start, then a loop over the
  chunks passes the true states on, and each chunk reads its incoming state. Autograd differentiates it.
  Chunks are balanced: L is split into ceil(L / Q) chunks of equal length, Q = min(chunk_size, TORCH_CHUNK) (the
  math does not depend on where chunks end, only the rounding does), so a short sequence is one chunk and little
  is padded.
- ``"cuda"``: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (needs the ``mamba-ssm`` package
  and CUDA tensors; it takes seq_idx and initial states too).
- ``"auto"`` (default): ``"cuda"`` when mamba-ssm imports and ``x`` is on CUDA, else ``"cpu"`` when the C++ module
  is built, else ``"chunked"``.

``ARCHSCALE_SCAN_IMPL=ref|chunked|cpu|cuda|auto`` replaces ``impl="auto"`` here as for Mamba-1's scan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from archscale.kernels import scan_cpu
from archscale.kernels.dispatch import Dispatch, Impl, cuda_impl
from archscale.kernels.selective_scan import ENV_VAR, _mamba_ssm
from archscale.kernels.ssd_fused import intra_chunk

# The CPU paths' longest chunk (the C++ kernel's and the torch chunked path's). Per token the intra-chunk
# products cost ~2 Q d_inner and the state's ~4 n d_inner whatever Q; a shorter chunk makes more, smaller gemms
# and sequential state steps. One scan forward + backward at B4 T512, 16 heads x 64, d_state 128 (2 cores,
# medians of 9, kernel then torch): the kernel 45-52 ms at Q = 64 against 50-61 ms at 128 and 75 ms at
# ArchScale's 256; the torch path 133 ms at 64 against 123 ms at 128 (an earlier run: 2.0 s either way, 3.5 s
# at 256). The result does not depend on the chunking except through rounding; mamba-ssm's CUDA kernel keeps
# chunk_size. `benchmarks/mamba2_throughput.py --torch_chunk Q` times the whole model at another Q.
TORCH_CHUNK = 64
# step 1 of the chunked path (the (Q, Q) decays and the intra-chunk product): True = `ssd_fused.intra_chunk`,
# one autograd node with a hand-written backward; False = the same maths through autograd (tests run both)
FUSED_INTRA = True



def cuda_ssd_available() -> bool:
    return torch.cuda.is_available() and _mamba_ssm("mamba_chunk_scan_combined") is not None


# ARCHSCALE_SCAN_IMPL is shared with Mamba-1's scan: "cpu" is the C++ module for both
SSD = Dispatch("ssd_scan", (
    cuda_impl("cuda", lambda: _mamba_ssm("mamba_chunk_scan_combined"), "mamba-ssm"),
    Impl("cpu", scan_cpu.unavailable_for),
    Impl("chunked"),
    Impl("ref"),
), env_var=ENV_VAR)


def document_starts(seq_idx: Tensor) -> Tensor:
    """(b, L) bool: True where a token's document label differs from the previous token's (never at t = 0)."""
    starts = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts


def chunk_layout(L: int, chunk_size: int) -> tuple[int, int]:
    """(number of chunks, chunk length) of the chunked path for a length-L sequence (balanced chunks)."""
    if L <= 0:
        return 0, 0
    nc = math.ceil(L / chunk_size)
    return nc, math.ceil(L / nc)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 256,
             D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
             seq_idx: Tensor | None = None, initial_state: Tensor | None = None,
             return_final_state: bool = False, impl: str = "auto"):
    """The SSD scan (module docstring). x (b, L, h, p); dt (b, L, h); A (h,); B, C (b, L, g, n); D (h,) or
    (h, p); dt_bias (h,); seq_idx (b, L) integer document labels; initial_state (b, h, p, n).

    Returns y (b, L, h, p) in x's dtype, or (y, final_state) with the final state (b, h, p, n) in fp32."""
    impl = SSD.resolve(impl, x=x)
    if impl == "cuda":
        fn = _mamba_ssm("mamba_chunk_scan_combined")
        out = fn(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                 initial_states=initial_state,
                 seq_idx=None if seq_idx is None else document_starts(seq_idx).cumsum(-1).to(torch.int32),
                 return_final_states=return_final_state)
        return (out[0], out[1].float()) if return_final_state else out

    with torch.autocast(device_type=x.device.type, enabled=False):
        xf, dtf = x.float(), dt.float()
        if dt_bias is not None:
            dtf = dtf + dt_bias.float()
        if dt_softplus:
            dtf = F.softplus(dtf)
        starts = None if seq_idx is None else document_starts(seq_idx)
        h0 = None if initial_state is None else initial_state.float()
        if impl == "cpu" and x.shape[1] > 0:  # the D skip is inside the kernel
            Dhp = None if D is None else (D.float()[:, None] if D.dim() == 1 else D.float()).expand(x.shape[2:])
            y, last = scan_cpu.ssd_chunks(xf, dtf, A.float(), B.float(), C.float(),
                                          chunk_layout(x.shape[1], min(chunk_size, TORCH_CHUNK))[1], starts, Dhp, h0)
            y = y.to(x.dtype)
            return (y, last) if return_final_state else y
        if impl == "ref":
            y, last = _ssd_ref(xf, dtf, A.float(), B.float(), C.float(), starts, h0)
        else:
            y, last = _ssd_chunked(xf, dtf, A.float(), B.float(), C.float(), min(chunk_size, TORCH_CHUNK),
                                   starts, h0)
        if D is not None:
            Df = D.float()
            y = y + (Df[:, None] if Df.dim() == 1 else Df) * xf
    y = y.to(x.dtype)
    return (y, last) if return_final_state else y


def ssd_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                     D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = True) -> Tensor:
    """One decoding step. state (b, h, p, n) fp32, updated in place; x (b, h, p); dt (b, h); A, dt_bias, D (h,);
    B, C (b, g, n). Returns y (b, h, p) in x's dtype. mamba-ssm's Triton kernel on CUDA when installed."""
    h, p = x.shape[1:]
    fn = _mamba_ssm("selective_state_update") if state.is_cuda else None
    if fn is not None:  # its Mamba-2 form: per-(head, channel) copies of the per-head parameters
        n = state.shape[-1]
        return fn(state, x, dt[..., None].expand(-1, -1, p), A[:, None, None].expand(h, p, n).float(), B, C,
                  None if D is None else D[:, None].expand(h, p),
                  dt_bias=None if dt_bias is None else dt_bias[:, None].expand(h, p), dt_softplus=dt_softplus)
    with torch.autocast(device_type=x.device.type, enabled=False):
        xf, dtf = x.float(), dt.float()
        if dt_bias is not None:
            dtf = dtf + dt_bias.float()
        if dt_softplus:
            dtf = F.softplus(dtf)
        g = B.shape[1]
        Bh = B.float().repeat_interleave(h // g, dim=1)                      # (b, h, n)
        Ch = C.float().repeat_interleave(h // g, dim=1)
        decay = torch.exp(dtf * A.float())[..., None, None]                 # (b, h, 1, 1)
        new = decay * state + (dtf[..., None] * xf)[..., None] * Bh[:, :, None, :]
        state.copy_(new)
        y = torch.einsum("bhpn,bhn->bhp", new, Ch)
        if D is not None:
            y = y + D.float()[:, None] * xf
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------------------
# Reference: the recurrence one step at a time (fp32 in, fp32 out), differentiable through autograd.

def _ssd_ref(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, starts: Tensor | None, h0: Tensor | None):
    b, L, h, p = x.shape
    g, n = B.shape[2:]
    H = h0 if h0 is not None else x.new_zeros(b, h, p, n)
    Bh, Ch = B.repeat_interleave(h // g, dim=2), C.repeat_interleave(h // g, dim=2)   # (b, L, h, n)
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, t] * A)                                       # (b, h)
        if starts is not None:
            decay = decay * (~starts[:, t, None]).to(decay.dtype)            # a new document starts from 0
        H = decay[..., None, None] * H + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", H, Ch[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, h, p)
    return y, H


# --------------------------------------------------------------------------------------------------------------
# Chunked: the block decomposition. Index names: c chunk, l / s positions in a chunk (target / source).

def _ssd_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                 starts: Tensor | None, h0: Tensor | None):
    b, L, h, p = x.shape
    g, n = B.shape[2:]
    if L == 0:
        return _ssd_ref(x, dt, A, B, C, starts, h0)
    nc, Q = chunk_layout(L, chunk_size)
    pad = nc * Q - L
    if pad:  # dt = 0 steps: decay 1 and no input, so the state carries through; their outputs are dropped
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
        if starts is not None:
            starts = F.pad(starts, (0, pad))
    hg = h // g
    X = (x * dt[..., None]).view(b, nc, Q, g, hg, p)                          # dt_s x_s
    Bc, Cc = B.view(b, nc, Q, g, n), C.view(b, nc, Q, g, n)
    acum = (dt * A).view(b, nc, Q, h).transpose(2, 3).cumsum(-1)              # (b, c, h, Q), <= 0, decreasing
    # r: document starts so far inside the chunk; a product of decays over (s, l] is kept iff r_l == r_s
    r = None if starts is None else starts.view(b, nc, Q).cumsum(-1)

    # 1. inside each chunk: y_l = sum_{s<=l} (C_l . B_s) exp(acum_l - acum_s) dt_s x_s
    same = None if r is None else (r[..., :, None] == r[..., None, :])[:, :, None]  # (b, c, 1, Q, Q)
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)                           # (b, c, g, Q, Q)
    y = (intra_chunk if FUSED_INTRA else _intra_chunk_autograd)(acum, CB, X, same)

    # 2. each chunk's final state from a zero start: sum_s exp(acum_last - acum_s) dt_s x_s B_s^T
    to_end = torch.exp(acum[..., -1:] - acum)                                 # (b, c, h, Q)
    if r is not None:
        to_end = to_end * (r == r[..., -1:]).to(to_end.dtype)[:, :, None]
    Xd = X * to_end.transpose(2, 3).reshape(b, nc, Q, g, hg, 1)
    S = torch.einsum("bcsgn,bcsgkp->bcgkpn", Bc, Xd).reshape(b, nc, h, p, n)

    # 3. pass the states across chunks (a start anywhere in a chunk cuts what enters it off from its end)
    carry = torch.exp(acum[..., -1])                                          # (b, c, h)
    if r is not None:
        carry = carry * (r[..., -1] == 0).to(carry.dtype)[:, :, None]
    state = h0 if h0 is not None else x.new_zeros(b, h, p, n)
    entering = []
    for c in range(nc):
        entering.append(state)
        state = torch.addcmul(S[:, c], state, carry[:, c, :, None, None])
    Hin = torch.stack(entering, 1).view(b, nc, g, hg, p, n)

    # 4. each position reads the state entering its chunk, decayed by exp(acum_l) (0 after a start)
    from_start = torch.exp(acum)
    if r is not None:
        from_start = from_start * (r == 0).to(from_start.dtype)[:, :, None]
    y_off = torch.einsum("bclgn,bcgkpn->bclgkp", Cc, Hin)
    y = y + y_off * from_start.transpose(2, 3).reshape(b, nc, Q, g, hg, 1)
    return y.reshape(b, nc * Q, h, p)[:, :L], state


def _intra_chunk_autograd(acum: Tensor, CB: Tensor, X: Tensor, same: Tensor | None) -> Tensor:
    """Step 1 of the chunked path through autograd (what `ssd_fused.intra_chunk` computes with its own backward;
    kept as the second path its tests compare). The diagonal is exactly 1 and independent of A: kept out of the
    exp so that its gradient paths into acum_l and acum_s (equal and opposite) are not formed at all."""
    b, nc, g, Q, _ = CB.shape
    hg = X.shape[-2]
    eye = torch.eye(Q, dtype=X.dtype, device=X.device)
    keep = torch.ones(Q, Q, dtype=torch.bool, device=X.device).tril(-1)
    if same is not None:
        keep = keep & same
    decay = torch.exp((acum[..., :, None] - acum[..., None, :]).masked_fill(~keep, -math.inf)) + eye
    M = decay.view(b, nc, g, hg, Q, Q) * CB[:, :, :, None]
    return torch.einsum("bcgkls,bcsgkp->bclgkp", M, X)
