"""
reward_model.py: reward models exact against transformers (tests/fixtures/rm: tiny Llama, Qwen2 and Qwen3 sequence
classifiers with the scores transformers computes, alone and in right- and left-padded batches), the judge's read of
its next-token distribution against a brute-force forward of each prompt alone, packed = unpacked, and every bad
input a one-line error before any rollout.
"""
import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import reward_model
from configurator import ConfigError
from model import GPT
from lib.chat import apply_chat_template, checkpoint_template, render_answered
from lib.tokenizer import get_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RM = os.path.join(ROOT, 'tests', 'fixtures', 'rm')
FAMILIES = ('llama', 'qwen2', 'qwen3')  # llama: bf16 weights in three shards, Llama-3.1's template; Qwen: Qwen2.5's


def settings(**kw):
    return SimpleNamespace(**{**dict(reward_model_dtype='float32', device='cpu', micro_batch_size=64, plain=False,
                                     reward_clip=0.0, judge_prompt=reward_model.YES_NO, judge_tokens=('Y', 'N')),
                              **kw})


def reference(family):
    with open(os.path.join(RM, family, 'reference.json'), encoding='utf-8') as f:
        return json.load(f)


@pytest.mark.parametrize('family', FAMILIES)
def test_the_conversation_is_rendered_and_tokenized_as_transformers_does(family):
    ref, path = reference(family), os.path.join(RM, family)
    template = checkpoint_template(path)
    enc = get_tokenizer(path)
    for c, text, ids in zip(ref['conversations'], ref['texts'], ref['ids']):
        assert render_answered(template, c['prompt'], c['completion']) == text
        assert enc.encode(text, allowed_special='all') == ids


def test_a_template_in_chat_template_jinja_is_read(tmp_path):
    """transformers 5 writes the template as chat_template.jinja beside tokenizer_config.json."""
    ref, path = reference('qwen2'), shutil.copytree(os.path.join(RM, 'qwen2'), tmp_path / 'rm')
    config = json.load(open(path / 'tokenizer_config.json'))
    (path / 'chat_template.jinja').write_text(config.pop('chat_template'), encoding='utf-8')
    json.dump(config, open(path / 'tokenizer_config.json', 'w'))
    c = ref['conversations'][1]
    template = checkpoint_template(str(path))
    assert render_answered(template, c['prompt'], c['completion']) == ref['texts'][1]


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('micro_batch_size, plain', [(64, False), (3, False), (1, False), (64, True), (3, True)])
def test_scores_equal_transformers(family, micro_batch_size, plain):
    """Float32 scores within 1e-4 of transformers' alone and in its padded batches, packed (a prompt's tokens once
    for the rows that share it) or not, in micro-batches of any size; the policy's chat template plays no part."""
    ref = reference(family)
    fn = reward_model.reward_fn(f'rm:{RM}/{family}', settings(micro_batch_size=micro_batch_size, plain=plain,
                                                              chat_template='none'))
    got = torch.tensor(fn([c['prompt'] for c in ref['conversations']], [c['completion'] for c in ref['conversations']]))
    for key in ('scores_alone', 'scores_right_padded', 'scores_left_padded'):
        torch.testing.assert_close(got, torch.tensor(ref[key]), atol=1e-4, rtol=0)
    assert got.std() > 0.1 and fn.__name__ == f'rm:{family}'


@pytest.mark.parametrize('family', FAMILIES)
def test_a_row_ending_in_the_pad_token_is_read_before_it(family):
    """transformers reads the score at the last token that is not the pad id: a row cut right after an
    <|endoftext|> (the pad token here) scores as if the pad were not there."""
    case = reference(family)['pad_at_end']
    model, head, pad = reward_model.load_classifier(os.path.join(RM, family))
    ids = case['ids']
    assert ids[-1] == pad and case['read_index'] == len(ids) - 2
    got = reward_model.classifier_scores(model, head, pad, [ids, ids[:-1]], [0, 1], settings())
    assert abs(got[0].item() - case["score"]) < 1e-4 and abs(got[0] - got[1]) < 1e-6


def test_bf16_weights_and_clipping():
    ref = reference('llama')
    prompts, completions = ([c[k] for c in ref['conversations']] for k in ('prompt', 'completion'))
    half = reward_model.reward_fn(f'rm:{RM}/llama', settings(reward_model_dtype='bfloat16'))(prompts, completions)
    assert max(abs(a - b) for a, b in zip(half, ref['scores_alone'])) < 0.1  # bf16 compute: close, not exact
    clipped = reward_model.reward_fn(f'rm:{RM}/llama', settings(reward_clip=0.5))(prompts, completions)
    assert clipped == [min(max(s, -0.5), 0.5) for s in
                       reward_model.reward_fn(f'rm:{RM}/llama', settings())(prompts, completions)]


@pytest.fixture(scope='module')
def judge(tmp_path_factory):
    """A causal LM with the Qwen2.5 template and tokenizer: tiny-qwen2-a's weights, rm/qwen2's tokenizer files."""
    d = tmp_path_factory.mktemp('judge') / 'tiny-judge'
    shutil.copytree(os.path.join(ROOT, 'tests', 'fixtures', 'tiny-qwen2-a'), d)
    for f in ('tokenizer.json', 'tokenizer_config.json'):
        shutil.copy(os.path.join(RM, 'qwen2', f), d / f)
    return str(d)


PROMPTS = ['What is 2 + 3?', 'What is 2 + 3?', 'What is 2 + 3?', [dict(role='user', content='Name a colour.')]]
COMPLETIONS = ['5', 'It is 5.', '', 'Blue, or perhaps 7.']


def brute_force(path, tokens, prompts, completions, judge_prompt):
    """Each judge prompt forwarded alone, the whole vocabulary's logits at its last position, softmax, the tokens'
    probabilities: P(first) / P(both), or with numbers the expected value."""
    model = GPT.from_pretrained(path, dtype=torch.float64).eval()
    enc = get_tokenizer(path)
    template = checkpoint_template(path)
    ids = [enc.encode_single_token(t) for t in tokens]
    values = [float(t) for t in tokens] if all(t.isdigit() for t in tokens) else [1.0, 0.0]
    out = []
    for p, c in zip(prompts, completions):
        text = p if isinstance(p, str) else p[-1]['content']
        question = judge_prompt.replace('{prompt}', text).replace('{completion}', c)
        row = enc.encode(apply_chat_template(template, [dict(role='user', content=question)],
                                             add_generation_prompt=True), allowed_special='all')
        probs = model.logits(torch.tensor([row]))[0, -1].softmax(-1)[ids]
        out.append((sum(v * q for v, q in zip(values, probs)) / probs.sum()).item())
    return out


@pytest.mark.parametrize('tokens', [('Y', 'N'), ('1', '2', '3', '4', '5')])
@pytest.mark.parametrize('micro_batch_size, plain', [(64, False), (1, False), (64, True)])
def test_the_judge_reads_its_next_token_distribution(judge, tokens, micro_batch_size, plain):
    cfg = settings(judge_tokens=tokens, micro_batch_size=micro_batch_size, plain=plain)
    got = reward_model.reward_fn(f'judge:{judge}', cfg)(PROMPTS, COMPLETIONS)
    want = brute_force(judge, tokens, PROMPTS, COMPLETIONS, cfg.judge_prompt)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    assert len(set(got)) == len(got)  # each completion its own reward


def test_a_text_longer_than_the_judge_s_context_is_read_at_its_end(judge):
    """Model text never raises: a judge prompt past the judge's block_size (256 here) keeps its last 256 tokens."""
    model = GPT.from_pretrained(judge, dtype=torch.float32).eval()
    long = ' '.join(['seven'] * 400)
    for plain in (False, True):
        got = reward_model.last_hidden(model, [[5] * 300, [5] * 10], [0, 1], settings(plain=plain))
        torch.testing.assert_close(got[0], model.hidden(torch.tensor([[5] * 256]))[0, -1], atol=1e-5, rtol=0)
    assert 0 < reward_model.reward_fn(f'judge:{judge}', settings())(['What is 7 times 8?'], [long])[0] < 1


def test_a_gguf_judge(tmp_path):
    """A judge from a .gguf (its tokenizer and chat template in the file), as llama.cpp's converter writes it."""
    pytest.importorskip('gguf')
    from gguf_writer import FIXTURES, write_gguf
    path = str(tmp_path / 'judge.gguf')
    write_gguf(path, GPT.from_pretrained(os.path.join(FIXTURES, 'tiny-qwen2-a'), dtype=torch.float32), 'F32',
               hub='qwen2.5')
    got = reward_model.reward_fn(f'judge:{path}', settings())(PROMPTS, COMPLETIONS)
    want = brute_force(path, ('Y', 'N'), PROMPTS, COMPLETIONS, reward_model.YES_NO)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def edited_rm(tmp_path, config=None, drop=(), tokenizer=None):
    """rm/qwen2 copied, its config.json updated with `config`, the tensors in `drop` removed, tokenizer.json's added
    tokens extended by `tokenizer` ({content: id})."""
    d = tmp_path / 'rm'
    shutil.copytree(os.path.join(RM, 'qwen2'), d)
    c = json.load(open(d / 'config.json'))
    json.dump({**c, **(config or {})}, open(d / 'config.json', 'w'))
    if drop:
        tensors = load_file(d / 'model.safetensors')
        save_file({k: v for k, v in tensors.items() if k not in drop}, d / 'model.safetensors')
    if tokenizer:
        t = json.load(open(d / 'tokenizer.json'))
        t['added_tokens'] += [dict(t['added_tokens'][0], id=i, content=s) for s, i in tokenizer.items()]
        json.dump(t, open(d / 'tokenizer.json', 'w'))
    return str(d)


@pytest.mark.parametrize('case, message', [
    ('causal', "is a Qwen2ForCausalLM, not a sequence classifier (LlamaForSequenceClassification, ...); a causal LM "
               "can judge instead: 'judge:"),
    ('labels', "has num_labels 2; a reward model has one output"),
    ('no head', "has no score layer of one output, 'score.weight' of shape (1, 64) alone (its score tensors: none)"),
    ('tokenizer', "n_vocab 601; pick the tokenizer the model was trained with"),
    ('template', "has no chat template (chat_template.jinja, chat_template.json or "
                 "tokenizer_config.json's chat_template); a reward model or judge reads its own: "
                 "put the one it was trained with there"),
    ('template tokens', "chat template writes the special tokens ['<|begin_of_text|>', "
                        "'<|end_header_id|>', '<|eot_id|>', '<|start_header_id|>'], which "
                        "tokenizer"),
    ('missing', "not found; give a Hugging Face directory"),
    ('judge prompt', "judge_prompt must hold {prompt} and {completion}"),
    ('judge tokens', "judge_tokens=('Yes', 'No'): give two or more strings that are one token each"),
])
def test_bad_reward_models_are_one_line_errors(tmp_path, judge, case, message):
    cfg, name = settings(), None
    if case == 'causal':
        name = f'rm:{judge}'
    elif case == 'labels':
        name = 'rm:' + edited_rm(tmp_path, config=dict(id2label={'0': 'BAD', '1': 'GOOD'}))
    elif case == 'no head':
        name = 'rm:' + edited_rm(tmp_path, drop=('score.weight',))
    elif case == 'tokenizer':  # a tokenizer with ids past the model's 576 rows: another model's
        name = 'rm:' + edited_rm(tmp_path, tokenizer={'<|extra|>': 600})
    elif case == 'template':
        name = 'rm:' + edited_rm(tmp_path)
        os.remove(name[3:] + '/tokenizer_config.json')
    elif case == 'template tokens':  # Llama-3.1's template over Qwen's tokenizer
        name = 'rm:' + edited_rm(tmp_path)
        shutil.copy(os.path.join(RM, 'llama', 'tokenizer_config.json'), name[3:])
    elif case == 'missing':
        name = f'rm:{tmp_path}/nothing'
    elif case == 'judge prompt':
        name, cfg = f'judge:{judge}', settings(judge_prompt='Is this good? {completion}')
    else:
        name, cfg = f'judge:{judge}', settings(judge_tokens=('Yes', 'No'))
    with pytest.raises(ConfigError) as e:
        reward_model.reward_fn(name, cfg)
    assert message in str(e.value) and '\n' not in str(e.value)
