# On-policy distillation on a laptop (docs/distillation.md): SmolLM2-135M-Instruct learns its
# times tables from a teacher alone, the same model after config/smollm2.py's RL. Stacked on
# config/smollm2.py, whose task, batch, sampler and learning rate it keeps; the teacher scores
# every token the student samples.
# the teacher, out-smollm2/ckpt-000020:
# $ python train.py config/smollm2.py
# the student, from the teacher:
# $ python train.py config/smollm2.py config/distill_smollm2.py
out_dir = 'out-distill-smollm2'
teacher = 'out-smollm2/ckpt-000020'
# A_t = log q(y_t) - log pi(y_t), each token's own (tinker's default)
teacher_weight = 1.0
teacher_discount = 0.0
# distillation alone: the reward is scored and logged (acc), weighed 0; all its groups are then
# flat in reward, which is why dynamic sampling stays off
reward_funcs = ('numeric_match',)
reward_weights = (0.0,)
