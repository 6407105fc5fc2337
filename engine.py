"""
The sampling engine behind GPT.generate: G completions per prompt from a static KV
cache, each prompt prefilled once straight into the cache rows of its samples (as
nanochat's engine does), then every row decoded together one token a step with
GPT.decode, each row's token going into its own next cache column (rows are level,
except that a multi-turn row jumps ahead by each observation it reads in).

The cache is allocated once for a call's batch and sequence and never moved
(finished rows are dropped by copying the live ones into its first rows), and freed
when the call returns, leaving its memory to the update. With model.decode_graphs
(train.py's cuda_graphs) the steps are replayed as CUDA graphs instead
(lib/cuda_graphs.py), and the cache is kept across calls, grown to the largest batch
and sequence seen, since a graph reads the addresses it was captured with.

With max_rows (refill), at most that many rows decode at once: a row's slot frees
when the row ends, a prompt is seated when G slots are free, and its group leaves
when its G rows have ended (refill yields the groups as they leave). Rows are then
not level. A row's draws are indexed by its prompt, sample and step, so it samples
what it would in one batch.
"""
import collections
import contextlib
from dataclasses import dataclass
import itertools
import weakref

import torch
import torch.nn.functional as F

from sampling import draw_uniforms, eos_tensor, sample
from lib import cuda_graphs, multiturn
from lib.parallelism import stopping

# model -> its static cache: off the module, so state_dict and deepcopy skip it
_CACHES = weakref.WeakKeyDictionary()
# decode steps between the loop's host syncs: "has every row ended?" and dropping
# finished rows
CHECK_EVERY = 8


@torch.no_grad()
def generate(model, prompts, max_new_tokens, *, num_samples=1, temperature=1.0,
             top_k=None, top_p=None, eos_id=None, generator=None, turns=None,
             turn_workers=1, max_rows=0):
    """GPT.generate: sample num_samples completions for each prompt (a list of
    token-id lists of any lengths). Returns (tokens, mask, logprobs), each (N, L)
    with N = len(prompts) * num_samples rows in prompt-major order and
    L <= max_new_tokens the steps taken. eos_id: one id or several (Qwen's instruct
    models stop on <|im_end|> and <|endoftext|>). A row ends at its first eos,
    which it keeps; after it tokens are the smallest eos id (0 if None), mask is
    False and logprobs 0. logprobs: each token's under the distribution it was
    drawn from (see sample), as logprobs() computes it with the same top_k and
    top_p. temperature=0 is greedy, with log-probs at temperature 1. generator: one
    torch.Generator for the whole batch, or a list of one per prompt, whose draws
    then depend on nothing else: a prompt gets the same samples alone or in any
    batch. turns (multi-turn): called as turns(row, ids) when a row samples an eos
    id, with the row's tokens so far; it returns the token ids of an observation to
    append (the row then goes on) or None (the row ends). The observation's tokens
    are in tokens, with mask False and logprobs 0: context, not the policy's
    actions. The calls of one step run in turn_workers threads (the observations in
    row order), for a turns that depends on its arguments alone. max_rows: decode
    at most that many rows at once, a prompt's G rows seated as others' leave
    (refill); 0: all rows at once. The same samples either way. A stop signal
    (parallelism.stopping) ends the loop of all rows at once early (the run drops
    what the call sampled); refill's runs to its end.

    The loop is engine.py's: each prompt prefilled once, straight into the cache
    rows of its samples, right-aligned so that the rows decode level (a per-row key
    mask hides the left padding), in a static cache the model keeps across calls;
    an observation is read into its row's cache in one forward of its tokens.
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    with session(model, turns, turn_workers) as observe:
        if max_rows:
            groups = refill(model, prompts, max_new_tokens,
                            samples_per_prompt=num_samples,
                            max_rows=max_rows, sampling=sampling,
                            eos_id=eos_id, generator=generator,
                            turns=observe)
            return collect(groups, eos_id)
        return _generate(model, prompts, max_new_tokens, num_samples,
                         sampling, eos_id, generator, observe)


@contextlib.contextmanager
def session(model, turns, turn_workers):
    """What a call samples under: the observer of its multi-turn rows (None: one
    turn), each weight cast once (cast_once); on leaving, the static cache freed,
    unless graphs need it kept."""
    try:
        observer = (multiturn.observer(turns, turn_workers) if turns
                    else contextlib.nullcontext())
        with observer as observe, cast_once(model):
            yield observe
    finally:
        # only the graphs need the cache where it was
        if not model.decode_graphs:
            _CACHES.pop(model, None)


@contextlib.contextmanager
def cast_once(model):
    """Under autocast, each weight cast to bf16 once a call, not once a step:
    autocast keeps its casts (until its block ends) of parameters that require grad
    only, so a frozen one (LoRA's base, its output layer most of all) is marked as
    one meanwhile; under no_grad that builds no graph, and changes no number."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def static_cache(model, N, S, dtype, device):
    """The model's KV cache with at least N rows and S columns: per layer keys and
    values (rows, nkv, cols, hs), and a key mask (rows, cols). With graphs, kept for
    the next call and grown (to the largest rows and columns asked so far;
    cuda_graphs keeps its graphs in it, so they go with it) only when a call needs
    more. Zeros, not empty: masked columns get attention weight 0, and 0 * NaN
    garbage would still be NaN; after that only the model's own keys and values are
    written."""
    cfg, c = model.config, _CACHES.get(model)
    # the first layer's: all layers' are alike
    keys = None if c is None else c["kv"][0][0]
    fits = keys is not None and keys.shape[0] >= N and keys.shape[2] >= S
    if not fits or keys.dtype != dtype or keys.device != device:
        rows, cols = ((N, S) if c is None
                      else (max(N, keys.shape[0]), max(S, keys.shape[2])))
        # free the old one before allocating the new
        _CACHES.pop(model, None)
        c = _CACHES[model] = dict(
            kv=[[torch.zeros(rows, cfg.n_kv_head, cols, cfg.head_dim,
                             dtype=dtype, device=device)
                 for _ in "kv"] for _ in range(cfg.n_layer)],
            mask=torch.zeros(rows, cols, dtype=torch.bool, device=device))
    return c


@dataclass
class Batch:
    """The rows still decoding. Each field holds one entry a row, in batch order;
    drop_finished removes the finished rows from all of them at once, and from the
    cache."""
    out_row: torch.Tensor  # (n,) the row of the output each batch row writes to
    # (n,) the row's prompt length: its positions go on from there
    prompt_len: torch.Tensor
    # (n,) the index of the row's newest token, which is in cache column
    # prompt_width + newest
    newest: torch.Tensor
    # (n,) bool: the row has ended, and writes its tokens where they are never
    # returned
    done: torch.Tensor
    tok: torch.Tensor  # (n,) the newest token, the next decode step's input
    logp: torch.Tensor  # (n,) its log-prob
    # per layer (keys, values), each (n, n_kv_head, columns, head_dim): views into
    # the static cache
    kv: list
    # (n, columns) False where a row's prompt is padded on the left
    key_mask: torch.Tensor
    # the largest newest index (a row that read an observation is ahead of the
    # others)
    furthest: int = 0


@dataclass
class Output:
    """What generate returns, filled one step at a time. Step-major: tokens[t] holds
    each row's t-th token; the last row, tokens[steps], is where finished rows
    write, and is never returned."""
    tokens: torch.Tensor  # (steps + 1, N)
    logps: torch.Tensor  # (steps + 1, N)
    # multi-turn: (steps + 1, N) bool, True where a token is an observation's
    observed: torch.Tensor = None
    last_own: list = None  # multi-turn: each row's index of its last own token

    @classmethod
    def blank(cls, steps, n_rows, *, fill, turns, device):
        """Every row filled with what a row holds after its end (fill)."""
        out = cls(tokens=torch.full((steps + 1, n_rows), fill, device=device),
                  logps=torch.zeros(steps + 1, n_rows, device=device))
        if turns is not None:
            out.observed = torch.zeros(steps + 1, n_rows, dtype=torch.bool,
                                       device=device)
            out.last_own = [steps - 1] * n_rows
        return out

    def record(self, batch):
        """Each row's newest token into its place (a finished row's into the
        discarded last row)."""
        at = torch.where(batch.done, len(self.tokens) - 1, batch.newest)
        self.tokens.index_put_((at, batch.out_row), batch.tok)
        self.logps.index_put_((at, batch.out_row), batch.logp)

    def rows(self, rows):
        """The Output of rows (a slice) alone."""
        pick = lambda x: None if x is None else x[:, rows]
        return Output(tokens=pick(self.tokens), logps=pick(self.logps),
                      observed=pick(self.observed),
                      last_own=(None if self.last_own is None
                                else self.last_own[rows]))


def _generate(model, prompts, max_new_tokens, samples_per_prompt, sampling,
              eos_id, generator, turns):
    """generate's loop: prefill the prompts, sample each row's first token, then
    one decode step a token for all the live rows together, ending rows at their
    eos and dropping the finished ones from the batch every few steps."""
    device, dtype, steps = (model.lm_head.weight.device,
                            model.compute_dtype(), max_new_tokens)
    n_rows, prompt_width = (len(prompts) * samples_per_prompt,
                            max(len(p) for p in prompts))
    # the last sampled token is never fed back
    columns = prompt_width + steps - 1
    cache = static_cache(model, n_rows, columns, dtype, device)
    # Every uniform the sampler will use, (steps, N, 2), drawn up front so that a
    # row's draws depend on nothing else.
    uniforms = draw_uniforms(generator, steps, len(prompts),
                             samples_per_prompt, device)
    eos = eos_tensor(eos_id, device)
    out = Output.blank(steps, n_rows, fill=fill_of(eos), turns=turns,
                       device=device)

    lens = torch.tensor([len(p) for p in prompts], device=device)
    batch = rows_of(cache, n_rows,
                    prompt_len=lens.repeat_interleave(samples_per_prompt),
                    done=False)
    each = [list(range(r, r + samples_per_prompt))
            for r in range(0, n_rows, samples_per_prompt)]
    logits = prefill(model, prompts, batch, rows=each,
                     prompt_width=prompt_width)
    batch.tok, batch.logp = sample(logits, **sampling, u=uniforms[0])
    decode = DecodeStep(model, cache, dtype, prompt_width, columns, uniforms,
                        sampling)
    for step in range(steps):
        out.record(batch)
        end_rows(model, batch, out, eos, turns, prompt_width, steps)
        if step == steps - 1:
            break
        # the loop's only host syncs
        if step % CHECK_EVERY == CHECK_EVERY - 1:
            if not drop_finished(batch, columns,
                                 compact=not model.decode_graphs):
                # every row has ended
                break
        # a stop signal: the run drops what this call samples, so it ends here
        if stopping():
            break
        decode(batch)
    return finish(out, eos, steps, device)


def refill(model, prompts, max_new_tokens, *, samples_per_prompt, max_rows,
           sampling, eos_id, generator, turns):
    """generate's loop with at most max_rows rows decoding at once, in a static
    cache of that many: a row's slot is free once the row has ended, a waiting
    prompt is seated (prefilled once into G free rows) whenever G are free, and its
    group leaves when its G rows have ended. Yields (i, tokens, mask, logprobs) for
    each prompt i, each (G, L_i) as generate returns rows, in the order the groups
    leave, so that a caller can take each group as it ends. A row's draws are
    indexed by its prompt, sample and step, so it samples what it would with all
    the rows at once."""
    G, steps = samples_per_prompt, max_new_tokens
    if max_rows < G:
        raise ValueError(f"max_rows={max_rows} holds no group of "
                         f"num_samples={G} rows: make it >= {G}, "
                         f"or 0 for all rows at once")
    device, dtype = model.lm_head.weight.device, model.compute_dtype()
    n_rows, prompt_width = (min(max_rows, len(prompts) * G),
                            max(len(p) for p in prompts))
    columns = prompt_width + steps - 1
    cache = static_cache(model, n_rows, columns, dtype, device)
    uniforms = draw_uniforms(generator, steps, len(prompts), G, device)
    eos = eos_tensor(eos_id, device)
    out = Output.blank(steps, len(prompts) * G, fill=fill_of(eos),
                       turns=turns, device=device)
    # No row seated yet: all finished and free. A free row decodes too, its output
    # thrown away; one never seated attends to every column, as some attention
    # kernels give a row that attends to none NaN, and NaN logits draw a token
    # outside the vocabulary.
    placeholder = torch.ones(n_rows, dtype=torch.long, device=device)
    batch = rows_of(cache, n_rows, prompt_len=placeholder, done=True)
    batch.key_mask.fill_(True)
    seating = Seating(prompts, n_rows, G)
    draw = lambda logits, out_rows: sample(logits, **sampling,
                                           u=uniforms[0, out_rows])
    decode = DecodeStep(model, cache, dtype, prompt_width, columns, uniforms,
                        sampling)
    for step in itertools.count():
        # the loop's only host syncs
        if step % CHECK_EVERY == 0:
            for i in seating.leave(batch):
                yield (i,) + finish(out.rows(slice(i * G, (i + 1) * G)), eos,
                                    steps, device)
            seating.seat(model, batch, prompt_width=prompt_width, draw=draw)
            if not seating.decoding:
                return
            # none left to seat: finished rows are dropped as generate's
            if not seating.waiting:
                seating.compact(batch, columns,
                                compact=not model.decode_graphs)
        out.record(batch)
        end_rows(model, batch, out, eos, turns, prompt_width, steps)
        decode(batch)


class Seating:
    """refill's slots: the output row each batch row holds (None: free), the
    prompts waiting for G free rows (in order), and how many rows of each seated
    prompt are still decoding."""

    def __init__(self, prompts, n_rows, G):
        self.prompts, self.G, self.holds = prompts, G, [None] * n_rows
        self.waiting, self.decoding = (
            collections.deque(range(len(prompts))), {})

    def leave(self, batch):
        """Frees the rows that have ended, and returns the prompts none of whose rows
        decodes any more: their groups leave. A free row's newest is reset, so that
        the decode step's width follows the seated rows. One host sync."""
        done, newest = torch.stack([batch.done.long(), batch.newest]).tolist()
        for r, row in enumerate(self.holds):
            if row is not None and done[r]:
                self.decoding[row // self.G] -= 1
                self.holds[r] = None
        left = sorted(i for i, n in self.decoding.items() if n == 0)
        for i in left:
            del self.decoding[i]
        batch.newest[[r for r, row in enumerate(self.holds)
                      if row is None]] = 0
        held = [n for n, row in zip(newest, self.holds) if row is not None]
        batch.furthest = max(held, default=0)
        return left

    def seat(self, model, batch, *, prompt_width, draw):
        """As many waiting prompts as the free rows hold, each prefilled once into G
        free rows, which draw their first tokens: draw(logits, output rows)."""
        G, device = self.G, batch.tok.device
        free = [r for r, row in enumerate(self.holds) if row is None]
        new = [self.waiting.popleft()
               for _ in range(min(len(free) // G, len(self.waiting)))]
        if not new:
            return
        rows, out_rows = (free[:len(new) * G],
                          [i * G + s for i in new for s in range(G)])
        for r, row in zip(rows, out_rows):
            self.holds[r] = row
        self.decoding.update((i, G) for i in new)
        prompts = [self.prompts[i] for i in new]
        logits = prefill(model, prompts, batch, prompt_width=prompt_width,
                         rows=[rows[k:k + G] for k in range(0, len(rows), G)])
        rows, out_rows = (torch.tensor(x, device=device)
                          for x in (rows, out_rows))
        batch.tok[rows], batch.logp[rows] = draw(logits, out_rows)
        # their newest is 0 already (leave)
        batch.out_row[rows], batch.done[rows] = out_rows, False
        lens = torch.tensor([len(p) for p in prompts], device=device)
        batch.prompt_len[rows] = lens.repeat_interleave(G)

    def compact(self, batch, columns, compact):
        """drop_finished, the slots with it: the rows it keeps, the live ones, are
        those held (leave has just freed the ended ones)."""
        n_rows = len(batch.done)
        drop_finished(batch, columns, compact)
        if len(batch.done) < n_rows:
            self.holds = [row for row in self.holds if row is not None]


def collect(groups, eos_id):
    """refill's groups as generate returns its rows: (tokens, mask, logprobs), each
    (N, L) in prompt-major order, L the longest group's; a shorter group's rows are
    filled after their end as finish fills them."""
    # parts: the tokens, masks and logprobs
    _, *parts = zip(*sorted(groups, key=lambda group: group[0]))
    L = max(tokens.size(1) for tokens in parts[0])
    fills = fill_of(eos_tensor(eos_id, "cpu")), False, 0.0
    return tuple(torch.cat([F.pad(x, (0, L - x.size(1)), value=fill)
                            for x in xs])
                 for xs, fill in zip(parts, fills))


def fill_of(eos):
    """What a row holds after its end: the smallest eos id, 0 without one."""
    return 0 if eos is None else int(eos[0])


def rows_of(cache, n_rows, *, prompt_len, done):
    """The batch of the cache's first n_rows rows, whose prompts have lengths
    prompt_len (n_rows,), all finished (done True: no row seated yet) or none,
    before their first tokens."""
    device = cache["mask"].device
    zeros = torch.zeros(n_rows, dtype=torch.long, device=device)
    return Batch(out_row=torch.arange(n_rows, device=device),
                 prompt_len=prompt_len, newest=zeros,
                 done=torch.full((n_rows,), done, device=device),
                 tok=zeros.clone(),
                 logp=torch.zeros(n_rows, device=device),
                 key_mask=cache["mask"][:n_rows],
                 # each layer's keys and values: views
                 kv=[(k[:n_rows], v[:n_rows]) for k, v in cache["kv"]])


def prefill(model, prompts, batch, *, rows, prompt_width):
    """Each prompt once through the model, straight into the cache rows of its
    samples (rows[i]: prompt i's, a list), right-aligned at column prompt_width so
    that all rows then decode level (their key mask hides the left padding).
    Returns the logits (rows, vocab_size) each of those rows, prompt-major, draws
    its first token from."""
    device, columns = batch.key_mask.device, batch.key_mask.size(1)
    last_hidden = []  # each prompt's last hidden state (1, C)
    for prompt, at in zip(prompts, rows):
        padding, first = prompt_width - len(prompt), at[0]
        batch.key_mask[at] = torch.arange(columns, device=device) >= padding
        # Rows side by side are one view of the cache, which takes the keys and
        # values at once; scattered ones (refill) get copies of the first row's.
        side_by_side = at == list(range(first, first + len(at)))
        view = slice(first, first + len(at) if side_by_side else first + 1)
        # h: (1, len, C)
        h = model.hidden(torch.tensor(prompt, device=device)[None],
                         col=padding,
                         kv=[(k[view], v[view]) for k, v in batch.kv])
        if not side_by_side:
            for x in itertools.chain(*batch.kv):
                x[at[1:], :, padding:prompt_width] = x[first, :, padding:prompt_width]
        last_hidden.append(h[:, -1])
    # The output layer runs once for all prompts, so its weight is read (and under
    # autocast cast) once; each prompt's row of logits is repeated for its samples,
    # which draw from it independently.
    return model.lm_head(torch.cat(last_hidden)).repeat_interleave(len(rows[0]), 0)


def end_rows(model, batch, out, eos, turns, prompt_width, steps):
    """Mark the rows whose newest token ends them: at an eos or at the last step.
    With turns, a row that sampled an eos reads in its observation and goes on,
    unless its episode is over (lib/multiturn.py)."""
    if turns is not None:
        batch.tok, batch.logp, batch.done, ahead = multiturn.end_turns(
            turns, model, live=batch.out_row, tok=batch.tok, lp=batch.logp,
            j=batch.newest, done=batch.done, eos=eos, kv=batch.kv,
            key_mask=batch.key_mask, lens=batch.prompt_len, P=prompt_width,
            tokens=out.tokens, observed=out.observed, last=out.last_own)
        batch.furthest = max(batch.furthest, ahead)
    elif eos is not None:
        batch.done = batch.done | torch.isin(batch.tok, eos)
    # a row that read an observation, or was seated late (refill), reaches the
    # last step before the others
    batch.done = batch.done | (batch.newest == steps - 1)


def drop_finished(batch, columns, compact):
    """Returns False when every row has ended. Otherwise, when at least a quarter
    of the rows have ended, copies the live rows' caches into the first rows of the
    static cache (it never moves) and keeps only their entries in the batch. Not
    for fewer, as the copy has a cost; and not with CUDA graphs (compact False),
    which would capture a graph for each batch size, while a finished row costs a
    replayed step little (weights are read once)."""
    done = batch.done
    keep = (~done).nonzero().squeeze(1)
    if keep.numel() == 0:
        return False
    if keep.numel() <= 0.75 * done.numel() and compact:
        n = keep.numel()
        for k, v in batch.kv:
            k[:n, :, :columns], v[:n, :, :columns] = (k[keep, :, :columns],
                                                      v[keep, :, :columns])
        batch.key_mask[:n] = batch.key_mask[keep]
        batch.kv, batch.key_mask = ([(k[:n], v[:n]) for k, v in batch.kv],
                                    batch.key_mask[:n])
        for name in ("out_row", "prompt_len", "tok", "logp", "done",
                     "newest"):
            setattr(batch, name, getattr(batch, name)[keep])
    return True


class DecodeStep:
    """One decode step of the whole batch: each row's newest token into its next
    cache column, and the next token sampled. model.decode runs it, or with CUDA
    graphs lib/cuda_graphs.py replays it."""

    def __init__(self, model, cache, dtype, prompt_width, columns, uniforms,
                 sampling):
        if model.decode_graphs:
            self.step = cuda_graphs.decoder(model, cache, dtype)
        else:
            self.step = model.decode
        self.prompt_width, self.columns, self.uniforms = prompt_width, columns, uniforms
        # temperature, top_k and top_p, as decode takes them
        self.sampling = sampling
        # A step attends over the cache columns written so far, rounded up to a
        # multiple of 64, so that a compiled step or a graph sees few shapes:
        # reading the keys and values is most of a decode step's time outside the
        # matmuls. width: how many columns the step attends; sliced_from: the
        # batch's cache views the step's slices were taken from (drop_finished
        # replaces them).
        self.width, self.sliced_from = 0, None

    def __call__(self, batch):
        steps, prompt_width = len(self.uniforms), self.prompt_width
        # at most `columns`, not the cache's own (larger with graphs): the same
        # sums from call to call; narrower again when the furthest rows leave
        # (refill)
        width = min(self.columns,
                    (prompt_width + batch.furthest + 64) // 64 * 64)
        if batch.kv is not self.sliced_from or width != self.width:
            self.width = width
            self.kv = [(k[:, :, :self.width], v[:, :, :self.width])
                       for k, v in batch.kv]
            self.key_mask, self.sliced_from = batch.key_mask[:, :self.width], batch.kv
        # a finished row writes over its last column, which nothing reads again
        col = (prompt_width + batch.newest).clamp(max=self.columns - 1)
        uniforms = self.uniforms[(batch.newest + 1).clamp(max=steps - 1),
                                 batch.out_row]
        positions = batch.prompt_len + batch.newest
        batch.tok, batch.logp = self.step(
            tok=batch.tok, pos=positions, col=col, u=uniforms, kv=self.kv,
            key_mask=self.key_mask, **self.sampling)
        batch.newest = batch.newest + ~batch.done
        batch.furthest = min(batch.furthest + 1, steps - 1)


def finish(out, eos, steps, device):
    """(tokens, mask, logprobs), each (N, L): the steps up to any row's last own
    token, mask True on a row's own tokens up to its end."""
    tokens, logps = out.tokens[:steps].t(), out.logps[:steps].t()  # (N, steps)
    # a row's own tokens up to its last: never an observation's
    if out.observed is not None:
        mask = ~out.observed[:steps].t() & (
            torch.arange(steps, device=device)
            <= torch.tensor(out.last_own, device=device)[:, None])
    elif eos is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    else:
        # a row ends with its eos and is filled with eos after it: real tokens
        # have no eos before them
        is_eos = torch.isin(tokens, eos).int()
        mask = (is_eos.cumsum(1) - is_eos) == 0
    length = int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1
    return tuple(x[:, :length].contiguous() for x in (tokens, mask, logps))
