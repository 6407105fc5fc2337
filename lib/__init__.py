"""
What the GRPO core (the files at the top level) calls and a student can take on trust: formats (hf, gguf_file,
tokenizer, chat), speed (head: the chunked output layer; cpu_buffers; cuda_graphs), scale (parallelism, checkpoint,
lora), tools for multi-turn rollouts (envs, tools: the sandbox) and measuring (measure). Nothing here imports the
core: imports run one way, from the top level down.
"""
