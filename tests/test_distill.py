"""
On-policy distillation (issue 58, docs/distillation.md): loss.reverse_kl_advantages against a loop, the policy
gradient it gives through grpo_loss against the reverse KL's own gradient (every sequence of a tiny vocabulary
enumerated, float64), then the teacher in train.py: its log-probs under the sampler's truncation, the checks of
its path and tokenizer, and runs with LoRA, DDP, multi-turn, resume and no reward at all.
"""
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loss import grpo_loss, reverse_kl_advantages  # noqa: E402

DT = torch.float64


def loop_advantages(logps, teacher, mask, discount):
    """A_t = sum over the later counted tokens s >= t of discount^(s - t) (log q(y_s) - log pi(y_s)), by two loops."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=DT)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                out[i, t] = sum(discount ** (s - t) * (teacher[i, s] - logps[i, s]).item()
                                for s in range(t, T) if mask[i, s])
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_reverse_kl_advantages_match_a_loop(discount):
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 7, generator=g) < 0.7
    mask[1] = False
    # padding's log-probs are garbage, an observation's are the environment's: neither may reach an advantage
    logps = torch.where(mask, -torch.rand(6, 7, generator=g, dtype=DT), -1e30)
    teacher = torch.where(mask, -2 * torch.rand(6, 7, generator=g, dtype=DT), float('inf'))
    got = reverse_kl_advantages(logps, teacher, mask, discount)
    torch.testing.assert_close(got, loop_advantages(logps, teacher, mask, discount), rtol=1e-12, atol=1e-12)
    assert (got[~mask] == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# the gradient, exactly: a student and a teacher over V = 3 tokens (token 0 ends a sequence), T = 3 steps, every
# sequence enumerated. Each is a table of logits, one row per prefix (it depends on the whole prefix, as a model's).

V, T = 3, 3
PREFIXES = {p: k for k, p in enumerate(p for n in range(T) for p in itertools.product(range(V), repeat=n))}


def sequences():
    """Every sequence the policies can emit, as (tokens padded with 0, mask): it ends at token 0 or after T steps."""
    out = []
    for y in itertools.product(range(V), repeat=T):
        end = next((t + 1 for t, token in enumerate(y) if token == 0), T)
        if all(token == 0 for token in y[end:]):
            out.append((y, [t < end for t in range(T)]))
    return out


def table_logps(table, seqs):
    """(N, T) log pi(y_t | y_<t) of each sequence's tokens, and (N, T, V) the whole distribution at each step."""
    rows = torch.stack([table[PREFIXES[y[:t]]] for y, _ in seqs for t in range(T)]).view(len(seqs), T, V)
    dist = torch.log_softmax(rows, -1)
    tokens = torch.tensor([y for y, _ in seqs])
    return dist.gather(-1, tokens[..., None]).squeeze(-1), dist


def exact_kls(student, teacher, seqs, mask):
    """(the sequences' reverse KL, KL(pi || q) of whole sequences; the KL of each step summed over the states the
    student visits, their probabilities held fixed), exactly: sums over every sequence."""
    logp, dist = table_logps(student, seqs)
    logq, dist_q = table_logps(teacher, seqs)
    p = torch.where(mask, logp, 0.0).sum(-1).exp()  # (N,) each sequence's probability
    sequence_kl = (p * torch.where(mask, logp - logq, 0.0).sum(-1)).sum()
    step_kl = (dist.exp() * (dist - dist_q)).sum(-1)  # (N, T) KL(pi(.|y_<t) || q(.|y_<t))
    return sequence_kl, (p.detach() * torch.where(mask, step_kl, 0.0).sum(-1)).sum()


@pytest.mark.parametrize("loss_type", ["dr_grpo", "luspo", "dapo"])
def test_the_policy_gradient_is_the_reverse_kl_s(loss_type):
    """E over the student's samples of sum_t A_t grad log pi(y_t), through grpo_loss (each sequence weighed by its
    probability, as the sampler would draw it), is -grad of the reverse KL: of each step's at the states the student
    visits with discount=0, of whole sequences with discount=1; and the two differ, so neither passes by chance."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(len(PREFIXES), V, generator=g, dtype=DT).requires_grad_(True)
    teacher = torch.randn(len(PREFIXES), V, generator=g, dtype=DT)
    seqs = sequences()
    mask = torch.tensor([m for _, m in seqs])
    sequence_kl, step_kl = exact_kls(student, teacher, seqs, mask)
    grad = lambda x: torch.autograd.grad(x, student, retain_graph=True)[0]  # noqa: E731
    want = {1.0: grad(sequence_kl), 0.0: grad(step_kl)}
    logp = table_logps(student, seqs)[0]
    logq = table_logps(teacher, seqs)[0]
    p = torch.where(mask, logp, 0.0).sum(-1).exp().detach()  # (N,)
    counts = dict(num_sequences=1, max_completion_length=1, num_tokens=1)
    for discount, grad_kl in want.items():
        # the sampler's log-probs: constants
        A = reverse_kl_advantages(logp.detach(), logq, mask, discount)
        loss, _ = grpo_loss(logp, None, None, p[:, None] * A, mask, loss_type=loss_type, **counts)
        torch.testing.assert_close(grad(loss), grad_kl, rtol=1e-10, atol=1e-12)
    assert (want[1.0] - want[0.0]).abs().max() > 1e-3


def test_one_token_is_the_kl_of_one_distribution():
    """T = 1 by hand: -E_y[(log pi(y) - log q(y)) grad log pi(y)] = -grad KL(pi || q) of one softmax."""
    z = torch.tensor([0.3, -1.0, 2.0], dtype=DT, requires_grad=True)
    q = torch.log_softmax(torch.tensor([1.0, 0.0, -0.5], dtype=DT), 0)
    logp = torch.log_softmax(z, 0)
    (grad_kl,) = torch.autograd.grad((logp.exp() * (logp - q)).sum(), z, retain_graph=True)
    A = reverse_kl_advantages(logp.detach()[:, None], q[:, None], torch.ones(3, 1, dtype=torch.bool))
    loss, _ = grpo_loss(logp[:, None], None, None, logp.exp().detach()[:, None] * A,
                        torch.ones(3, 1), loss_type="luspo", num_sequences=1)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], grad_kl, rtol=1e-12, atol=1e-14)
