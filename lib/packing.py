"""
Packing (speed machinery, no number changes): the rows of a step's micro-batches laid into as few sequences as
possible, each group's prompt once, so that the log-prob passes and the update do next to no work on padding or on a
prompt twice. rollout.micro_batches calls it; its plain reference there gives each row a padded sequence of its own
(train.py's plain=True). model.hidden reads the layout through `pos`.
"""
import torch


def micro_batches(batch, size, need):
    """Yield (index, micro-batch), the ceil(B / size) micro-batches of a step, every row of batch in exactly one,
    with next to no forward or backward work on padding, nor on a prompt twice. Each row needs its prompt and the
    completion tokens that count (causal attention never reads past them), and the rows of one prompt (a group)
    need its tokens once: a sequence holds a prompt but its last token once, then each of its rows as that last
    token and the row's completion, at the positions they have in the row (model.hidden lets such a row see the
    prompt before it and itself only). Rows are packed into sequences no longer than the longest row, first fit from
    the longest (long prompts and a long tail of completion lengths: one to three rows a sequence, more where their
    prompt is in it already), and the sequences, sorted by length, are cut into the micro-batches, each to its
    longest. A micro-batch holds idx (S, T) the packed tokens, pos (S, T) each token's position in its row (0 where
    a prompt begins), start (n,) where each of its n rows' completion begins, as a flat index into idx, tokens (how
    many of idx's are not padding), row_tokens (the rows' prompts and completions, a prompt once a row), and the
    batch's other tensors for those rows (index: their rows in batch), the (B, C) ones cut to their longest
    completion. The loss's step-wide normalisers make the update the same however rows are grouped (bnpo, a mean
    per micro-batch, aside). need (B,): each row's completion tokens up to the last that counts."""
    start, n, dev = batch['start'].tolist(), need.tolist(), need.device
    ids = {}  # one number per prompt: rows whose prompts are the same tokens share them
    prompt = [ids.setdefault(tuple(p[:s]), len(ids)) for p, s in zip(batch['idx'][:, :max(start)].tolist(), start)]
    longest = max(s + k for s, k in zip(start, n))  # every sequence holds up to the longest row
    seqs, room, held = [], [], []  # the rows of each sequence, the tokens it has left, the prompts in it
    for r in sorted(range(len(n)), key=lambda r: -start[r] - n[r]):  # first fit, longest first
        # where its prompt is already, a row costs its completion and one prompt token; elsewhere its whole length
        i = next((i for i, free in enumerate(room) if prompt[r] in held[i] and free > n[r]), None)
        if i is None:
            i = next((i for i, free in enumerate(room) if free >= start[r] + n[r]), len(seqs))
        if i == len(seqs):
            seqs.append([])
            room.append(longest)
            held.append(set())
        room[i] -= n[r] + 1 if prompt[r] in held[i] else start[r] + n[r]
        seqs[i].append(r)
        held[i].add(prompt[r])
    count = -(-len(n) // size)  # the micro-batches of rows alone, so every rank runs as many
    while len(seqs) < count:
        seqs.append([max(seqs, key=len).pop()])
    spans = []  # per sequence: (row, first, end, a row's own?) spans of batch['idx'], each prompt before its rows
    for s in seqs:
        groups = {}
        for r in s:
            groups.setdefault(prompt[r], []).append(r)
        spans.append([x for g in groups.values() for x in [(g[0], 0, start[g[0]] - 1, False)] +
                      [(r, start[r] - 1, start[r] + n[r], True) for r in g]])
    spans.sort(key=lambda s: sum(b - a for _, a, b, _ in s))
    for m in range(count):
        part = spans[m * len(spans) // count:(m + 1) * len(spans) // count]  # at most `size` sequences
        T = max(sum(b - a for _, a, b, _ in s) for s in part)
        begin = [q * T + sum(b - a for _, a, b, _ in s[:k]) for q, s in enumerate(part) for k in range(len(s))]
        r, a, b, own = (torch.tensor(x, device=dev) for x in zip(*[x for s in part for x in s]))
        begin, width = torch.tensor(begin, device=dev), b - a  # (spans,) flat index in (S, T) where each begins, tokens
        j = torch.arange(int(width.sum()), device=dev) - (width.cumsum(0) - width).repeat_interleave(width)  # in span
        at, within = begin.repeat_interleave(width) + j, a.repeat_interleave(width) + j  # flat index, position in row
        idx = batch['idx'].new_zeros(len(part) * T)  # padding: token 0 at position 0, a row of its own nobody reads
        idx[at] = batch['idx'][r.repeat_interleave(width), within]
        pos = torch.zeros_like(idx).index_put_((at,), within)
        rows = r[own]
        L = max(int(need[rows].max()), 1)
        mb = {k: v[rows, :L] if v.dim() == 2 else v[rows] for k, v in batch.items() if k not in ('idx', 'start')}
        yield rows, dict(mb, idx=idx.view(-1, T), pos=pos.view(-1, T), start=begin[own] + 1, tokens=len(at),
                         row_tokens=int((batch['start'][rows] + need[rows]).sum()))


def attention_mask(pos):
    """The key mask (B, 1, T, T) of packed rows, from each token's position pos (B, T) in its own row. A prompt
    begins at 0; a row begins wherever positions do not go on by one, and one that begins past 0 carries on the
    prompt before it (the rows of a group share its tokens): it sees the prompt's tokens at the positions before its
    own first one, and its own, never another row's."""
    t = torch.arange(pos.size(1), device=pos.device)
    new = torch.cat((pos[:, :1] >= 0, pos[:, 1:] != pos[:, :-1] + 1), 1)  # (B, T) a row begins here
    row, prompt = new.cumsum(1), (pos == 0).cumsum(1)  # (B, T) which row and which prompt a token is in
    first = pos - t + torch.where(new, t, 0).cummax(1).values  # (B, T) the position its row begins at
    seen = (row[:, :, None] == row[:, None, :]) | ((prompt[:, :, None] == prompt[:, None, :]) &
                                                   (pos[:, None, :] < first[:, :, None]))  # (B, T, T) q, k
    return seen.tril()[:, None]  # causal
