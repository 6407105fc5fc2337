"""
The output layer's log-probs of given tokens, and each position's entropy, computed in chunks of rows with a
hand-written backward (HeadLogprobs), so that neither a (B, T, vocab) float32 tensor nor a (V, C) weight gradient per
chunk ever exists. model.py's logprobs() calls it. On CPU each chunk is written into a buffer kept for reuse
(lib/cpu_buffers.py): speed machinery that changes no number.
"""

import torch

from lib.cpu_buffers import scratch
from lib.truncation import truncate_

def _like(x, rows, dtype=None):
    """A scratch buffer shaped like x (n, V), in x's dtype or dtype."""
    return scratch(rows, x.shape, dtype or x.dtype, x.device)

def _cast(x, dtype, rows):
    """x (n, V) in dtype, copied into a scratch buffer if it is not in dtype already."""
    return x if x.dtype == dtype else _like(x, rows, dtype).copy_(x)

def logprobs(h, weight, targets, *, temperature, entropy, dtype, recompute, top_k, top_p):
    """GPT.logprobs' output layer: [out] or [out, H] (entropy=True) for h (k, C), through HeadLogprobs in chunks of
    rows whose float32 logits take about 256 MB, the matmuls in dtype. Backward keeps each chunk's logits unless
    recompute (gradient checkpointing: memory before time) or no gradient is wanted."""
    hold = torch.is_grad_enabled() and not recompute
    out = HeadLogprobs.apply(h, weight, targets, temperature, max(1, 2**26 // len(weight)), dtype, entropy, hold,
                             (top_k, top_p))
    return list(out) if entropy else [out]

class HeadLogprobs(torch.autograd.Function):
    """out[i] = log softmax(h[i] @ weight.T / temperature)[targets[i]] for h (n, C): the output layer and its
    log-softmax, rows chunks of rows at a time, the matmuls in dtype, the softmax in float32. Backward takes each
    chunk's logits from forward when keep (V x 4 bytes more a position, until backward: faster) or, to save that
    memory, recomputes them from h, the same numbers either way, then d out[i] / d logits[i] = onehot(targets[i]) -
    softmax, and adds the chunk's weight gradient into one (V, C) buffer in place, where autograd through chunks
    would make a fresh (V, C) gradient per chunk and sum them (slower, and V x C x 4 bytes more a chunk).
    With entropy=True it also returns the entropy H[i] = -sum_j p_j log p_j of the same p = softmax(z), z = logits /
    temperature, from the same chunks, as (out, H); backward then adds dH / dz_j = -p_j (log p_j + H).
    cut = (top_k, top_p): with either set, p is q, softmax(z) renormalised over the tokens they keep
    (lib/truncation.py), in the formulas above too (the kept set is constant near z)."""

    @staticmethod
    def _logits(h, w, temperature, rows, targets, cut):  # w: in the matmuls' dtype, cast once a pass
        # (n, V) at least float32, even under autocast: the normaliser needs it (a float64 model keeps float64)
        logits = torch.mm(h.to(w.dtype), w.t(), out=scratch(rows, (len(h), len(w)), w.dtype, h.device))
        logits = _cast(logits, torch.promote_types(w.dtype, torch.float32), rows)
        logits = logits.div_(temperature) if temperature != 1 else logits
        return truncate_(logits, *cut, targets)

    @staticmethod
    def forward(ctx, h, weight, targets, temperature, rows, dtype, entropy=False, keep=False, cut=(None, None)):
        ctx.args = temperature, rows, dtype, cut
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: backward skips its term
        w = weight.to(dtype)
        out, ent, kept = [], [], []
        for i in range(0, max(len(h), 1), rows):  # one empty chunk when no position counts
            logits = HeadLogprobs._logits(h[i:i + rows], w, temperature, rows, targets[i:i + rows], cut)  # (n, V)
            logp = torch.log_softmax(logits, -1, out=_like(logits, rows))  # (n, V)
            out.append(logp.gather(1, targets[i:i + rows, None]).squeeze(1))
            if entropy:  # (n,) -sum_j p_j log p_j, p (n, V) in a buffer free again after this line
                ent.append(torch.exp(logp, out=_like(logp, rows)).mul_(logp).sum(-1).neg_())
            if keep:
                kept.append(logits)
            del logits, logp  # the next chunk can take logp's buffer (and logits' unless kept)
        out, ent = torch.cat(out), torch.cat(ent) if entropy else None
        ctx.save_for_backward(h, weight, targets, ent, *kept)  # H (n,) is cheap to keep and backward needs it
        return (out, ent) if entropy else out

    @staticmethod
    def backward(ctx, grad, grad_ent=None):
        # ent: H (n,), or None when forward did not compute it; kept: each chunk's logits, or none
        h, weight, targets, ent, *kept = ctx.saved_tensors
        temperature, rows, dtype, cut = ctx.args
        if grad is None and grad_ent is None:
            return (None,) * 9
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        w = weight.to(dtype)
        for c, i in enumerate(range(0, len(h), rows)):
            hc, sl = h[i:i + rows], slice(i, i + rows)  # (n, C)
            g = None if grad is None else grad[sl, None] / temperature  # (n, 1); / temperature: dz/dlogits
            # (n, V), never changed: forward's, or recomputed and then dropped as soon as read (a recompute holds
            # at most two (n, V) float32 tensors at a time)
            logits = kept[c] if kept else HeadLogprobs._logits(hc, w, temperature, rows, targets[sl], cut)
            buf = _like(logits, rows)
            if grad_ent is None:
                d = torch.softmax(logits, -1, out=buf).mul_(-g)  # (n, V) -p g
                del logits
            else:  # the log-prob's -p g plus g_H dH/dz = -p g_H (log p + H), as p (-g_H log p - (g + g_H H))
                gh = grad_ent[sl, None] / temperature  # (n, 1)
                logp = torch.log_softmax(logits, -1, out=buf)  # (n, V)
                del logits
                p = torch.exp(logp, out=_like(logp, rows))  # (n, V)
                d = logp.mul_(-gh).sub_(gh * ent[sl, None] + (0 if g is None else g)).mul_(p)  # (n, V) in place
                del p  # before the matmuls: at most two (n, V) float32 tensors at a time, as without entropy
            if g is not None:
                d = d.scatter_add_(1, targets[sl, None], g)  # + onehot(target) g
            d = _cast(d, dtype, rows)  # (n, V) gradient of the chunk's logits
            grad_h[sl] = d @ w
            if grad_w is not None and dtype == grad_w.dtype:
                grad_w.addmm_(d.t(), hc)
            elif grad_w is not None:  # autocast: in dtype, as an autocast Linear's weight gradient, summed in float32
                grad_w += d.t() @ hc.to(dtype)
            del d  # the next chunk can take its buffer
        return grad_h, grad_w, None, None, None, None, None, None, None
