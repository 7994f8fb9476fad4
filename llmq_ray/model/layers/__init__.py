"""The pieces every model family is made of, each a few hundred lines of explicit forward and backward kernels
over buffers the model allocates once: the unit loop's hooks (``units``), the block GEMMs in the model dtype or
FP8 (``linear``), norms, the token and position embeddings, attention with RoPE, QK-norm and document masking,
the chunked LM head with its fused loss, and Smooth-SwiGLU's per-channel factors.

A family module (llmq_ray/model/llama.py, gpt2.py) composes them; a plan applied from outside
(llmq_ray/parallel/tensor.py) may replace a piece with a parallel one of the same interface.
"""
