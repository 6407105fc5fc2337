"""
Multi-turn rollouts, entered only where a run names an environment (train.py's env; lib/envs.py): rollout.sample
asks episodes() for a turns callback and the record of each row's episode, and engine.py's decode loop calls
end_turns() at each step, which asks the environment what each row that ended a turn observes and reads that into
the row's KV cache in one forward. The observations' tokens are context, never actions: the loss masks them.
A single-turn run never imports the environments, the tools or their sandbox (environment() does, when asked).
"""
import functools
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from lib import chat
from lib.chat import text_of


def environment(name, sandbox, template, chat_template_kwargs):
    """The run's environment (lib/envs.py's get_env), imported only now: see the module's
    docstring. With a chat template, the tool turn it renders is checked now (chat.tool_turn), and
    where the template rewrites earlier turns a line says what the run does about it."""
    from lib.envs import get_env
    env = get_env(name, sandbox)
    tools = chat.tools_of(env)
    if template is not None and tools:
        user = dict(role='user', content='2+2?')
        chat.tool_turn(template, [user], [dict(role='tool', content='4')], tools=tools, **chat_template_kwargs)
    if template is not None and chat.rewrites_history(template, **chat_template_kwargs):
        print(f"note: {template.where}'s chat template renders a past turn differently once a "
              f"turn follows (Qwen3 drops its reasoning); this run keeps the tokens each turn "
              f"sampled and appends only what the template renders for what follows: a trajectory "
              f"is what the policy saw, not a re-rendering")
    return env


def stop_ids(env, enc):
    """The ids the sampler stops a row at for env's stop strings (episodes then asks whether the text ends
    with one): a stop that is one token, that token; a longer one, every ordinary token whose bytes end with its
    last byte."""
    return _stop_ids(tuple(getattr(env, 'stop', ())), enc)


@functools.lru_cache(maxsize=8)
def _stop_ids(stops, enc):
    ids, special = set(), {enc.encode_single_token(t) for t in enc.special_tokens_set}
    for s in stops:
        try:
            ids.add(enc.encode_single_token(s))
        except KeyError:
            last = s.encode()[-1:]
            ids.update(i for i in range(enc.n_vocab) if i not in special and _token_bytes(enc, i).endswith(last))
    return sorted(ids)


def _token_bytes(enc, i):
    try:
        return enc.decode_single_token_bytes(i)
    except KeyError:  # an id the vocabulary skips
        return b''


def episodes(env, rows, G, cfg, enc):
    """(turns, record, ends): a multi-turn generate's turns callback (engine.py), the record of each row's episode and
    the ids that end a turn (the eos ids and the environment's stops); rollout.sample calls it with an env only. After
    each turn the policy ends, env.step(row, text) gives the observation to append (text is the trajectory so far:
    the policy's turns and the observations between them) or None, the end of the episode, as is reaching max_turns
    turns."""
    record = [dict(observations=[], finished=False) for _ in range(len(rows) * G)]
    stops = tuple(getattr(env, 'stop', ()))

    def turns(i, ids):
        seen, text = record[i]['observations'], text_of(ids, cfg, enc)
        if ids[-1] not in cfg.eos_ids and not text.endswith(stops):
            return []  # a token a stop string of several ends with, but not the end of one: the turn goes on
        observation = env.step(rows[i // G], text) if len(seen) + 1 < cfg.max_turns else None
        if observation is None:
            record[i]['finished'] = True
            return None
        seen.append(content(observation))
        return encode_observation(observation, cfg, enc, episode=record[i], ids=ids,
                                  row=rows[i // G])
    return turns, record, cfg.eos_ids + stop_ids(env, enc)


def counts(record):
    """Per row: the observations the environment gave, and those that report an error (a malformed call)."""
    return dict(calls=torch.tensor([len(e['observations']) for e in record]),
                errors=torch.tensor([sum(o.lstrip().startswith('error') for o in e['observations']) for e in record]))


def metrics(info):
    """What the log says of the episodes, over all ranks (info's, from rollout.make_batch): how often the policy
    calls the environment, and how often it errs (a multi-turn run's: rollout_metrics calls it where info has
    'calls')."""
    calls, errors = info['calls'], info['errors']
    return {'env/call_rate': (calls > 0).double().mean().item(), 'env/calls': calls.mean().item(),
            'env/error_share': errors.sum().item() / max(calls.sum().item(), 1.0)}


def content(observation):
    """An observation's own text: a string's, or its messages' contents (what counts() and the
    rewards read)."""
    if isinstance(observation, str):
        return observation
    messages = [observation] if isinstance(observation, dict) else observation
    return '\n'.join(m['content'] for m in messages)


def _utf8(text):
    # a lone surrogate (a tool can echo one from the model's JSON) becomes '?': UTF-8 only
    return text.encode('utf-8', errors='replace').decode('utf-8')


def encode_observation(observation, cfg, enc, *, episode, ids, row):
    """An observation's token ids. A string is ordinary text, appended as it is (no special tokens,
    whatever it holds), as are the messages' contents in a run without a chat template. A message
    or a list of them (a tool's result: {'role': 'tool', 'content': ...}) is what the run's chat
    template renders for them after the policy's turn (chat.tool_turn): its turn markers are special
    tokens, the messages' text ordinary (chat.encode_pieces). The episode (a row's record) keeps the
    conversation for that: the prompt's messages, then each turn and its results; ids are the row's
    tokens so far, this turn's last."""
    if isinstance(observation, str) or cfg.template is None:
        return enc.encode_ordinary(_utf8(content(observation)))
    results = [observation] if isinstance(observation, dict) else list(observation)
    results = [dict(m, content=_utf8(m['content'])) for m in results]
    conversation = episode.setdefault('conversation',
                                      chat.prompt_messages(row['prompt'], cfg.system_prompt))
    turn = ids[episode.get('start', 0):]
    end = turn[-1:] if turn and turn[-1] in cfg.eos_ids else []
    own = enc.decode([x for x in turn[:len(turn) - len(end)] if x < enc.n_vocab])
    pieces = chat.tool_turn(cfg.template, conversation, results, end=enc.decode(end),
                            tools=chat.tools_of(cfg.environment), **cfg.chat_template_kwargs)
    new = chat.encode_pieces(pieces, enc)
    conversation += [dict(role='assistant', content=own), *results]
    episode['start'] = len(ids) + len(new)
    return new


@contextmanager
def observer(turns, workers):
    """turns (a row's callback, turns(row, ids)) as end_turns calls it, for all the rows that end a turn at one step:
    from `workers` threads where there are several (a tool that runs a program waits in a subprocess, not holding the
    GIL), the observations in the rows' order. None where there are no turns."""
    if turns is None or workers <= 1:
        yield turns and functools.partial(_observe, turns, None)
        return
    with ThreadPoolExecutor(workers) as pool:
        yield functools.partial(_observe, turns, pool)


# a row that ends a turn (its newest token is an eos id) gets the observation turns(row, its tokens so
# far) returns. That token and the observation's but the last go into the row's cache in one forward of the new
# tokens only (the rows that end a turn at the same step together); the observation's last token is then the row's
# newest, which the next decode step feeds like any other, sampling the row's own next token from it. The row goes
# on with the others, ahead of them in its cache.

def end_turns(turns, model, *, live, tok, lp, j, done, eos, kv, key_mask, lens, P, tokens, observed, last):
    """Call turns for the live rows whose newest token ends a turn and read in what it returns (an observation
    that runs past the last step is cut there and its row ends). Returns tok, lp and done, updated, and the largest
    j of a row that read one (0 if none); j, tokens, observed and last change in place."""
    M = tokens.size(0) - 1
    ends = (torch.isin(tok, eos) & ~done & ~observed[j, live]).nonzero().squeeze(1).tolist()  # the row's own eos
    if not ends:
        return tok, lp, done, 0
    reading, done, tok, lp = {}, done.clone(), tok.clone(), lp.clone()
    rows = [int(live[b]) for b in ends]
    observations = turns(rows, [tokens[:int(j[b]) + 1, row].tolist() for b, row in zip(ends, rows)])
    for b, row, observation in zip(ends, rows, observations):
        n = int(j[b])
        if observation is None:
            done[b], last[row] = True, n
            continue
        if n + len(observation) >= M - 1:  # no room left for the row's own tokens: cut, and the row ends
            observation, done[b] = observation[:M - 1 - n], True
        tokens[n + 1:n + 1 + len(observation), row] = torch.tensor(observation, dtype=tokens.dtype)
        observed[n + 1:n + 1 + len(observation), row] = True
        if observation and not done[b]:  # the turn's last token and the observation's but the last, from P + n
            reading[b] = (P + n, [int(tok[b])] + list(observation[:-1]))
            tok[b], lp[b], j[b] = observation[-1], 0.0, n + len(observation)
    if not reading:
        return tok, lp, done, 0
    b = torch.tensor(list(reading), device=tok.device)
    cols, chunks = zip(*reading.values())
    _read(model, list(chunks), rows=b, kv=kv, key_mask=key_mask, col=torch.tensor(cols, device=tok.device),
          lens=lens[b], P=P)
    return tok, lp, done, int(j[b].max())


def _observe(turns, pool, rows, ids):
    """turns(row, ids) of each row that ends a turn at this step, from the pool's threads where there is one (a
    tool that runs a program waits in a subprocess, not holding the GIL), the observations in the rows' order."""
    return list((pool.map if pool else map)(turns, rows, ids))


def _read(model, chunks, *, rows, kv, key_mask, col, lens, P):
    """One forward of the new tokens of rows (r,) of the cache (chunks: r token lists, from cache column col (r,)
    on), for their keys and values only: into those rows' cache."""
    r, T, dev = len(chunks), max(map(len, chunks)), rows.device
    idx = torch.tensor([c + c[-1:] * (T - len(c)) for c in chunks], device=dev)  # (r, T): padding after the end
    at = col[:, None] + torch.arange(T, device=dev)  # (r, T) the columns written; the padding's, past the end
    sub = [tuple(torch.cat((x[rows], x.new_zeros(r, x.size(1), T, x.size(3))), 2) for x in layer)
           for layer in kv]  # the rows' caches, copied, with room for the padding
    S = sub[0][0].size(2)
    mask = torch.cat((key_mask[rows], key_mask.new_zeros(r, T)), 1)[:, None, :] & \
        (torch.arange(S, device=dev) <= at[:, :, None])  # (r, T, S) causal, within each row
    pos = (lens[:, None] + at - P).clamp(max=model.config.block_size - 1)  # the padding's may run past the end
    model.hidden(idx, pos=pos, kv=sub, col=col, key_mask=mask[:, None])
    i, t = torch.tensor([(i, t) for i, c in enumerate(chunks) for t in range(len(c))], device=dev).t()  # not padding
    for layer, copied in zip(kv, sub):  # the new columns back into the cache
        for x, y in zip(layer, copied):
            x[rows[i], :, at[i, t]] = y[i, :, at[i, t]]
