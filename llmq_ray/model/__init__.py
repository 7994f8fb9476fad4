"""The math of one model replica: its configuration, the flat parameter layout and typed per-layer views, the
explicit forward and backward over preallocated buffers, the linear layers (bf16 / FP8), Hugging Face import and
export, generation and the tokenizer files an export carries.

Nothing here knows about streams, ZeRO, offloading or Ray: the model declares its units (embedding, each block,
the LM head) and the engine's schedule decides where their tensors live and when they run. Imports only the
kernel backends and the leaf modules (errors, options).
"""
