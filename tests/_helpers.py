"""Small helpers shared by several test modules (imported as ``from _helpers import ...``: pytest puts tests/
on sys.path, since tests/ is not a package)."""

import contextlib
import io
import json

import torch


class FakeTTY(io.StringIO):
    """A text stream that says it is a terminal, so progress bars draw on it."""

    def isatty(self):
        return True


def perturb_norms_and_biases(model) -> None:
    """Add 0.5 x N(0, 1) noise (seeded) to the QKV biases and the norm weights of ``model`` in place.

    Trained models have non-zero QKV biases and norm weights away from 1; init has neither, which would hide
    a bias applied at the wrong scale inside the FP8 GEMM."""
    gen = torch.Generator().manual_seed(123)
    for slot in model.layout:
        if slot.name.endswith(("qkv_b", "ln1_w", "ln2_w", "final_norm")):
            view = model.params[slot.offset:slot.end]
            noise = torch.randn(view.shape, generator=gen).to(view.device)
            view.add_((0.5 * noise).to(view.dtype))


def bf16_stochastic_neighbours(got_bf16, want_fp32):
    """Every got is one of the two stochastic-rounding candidates of want: want truncated to bf16 (towards
    zero) or the next bf16 away from zero."""
    bits = want_fp32.float().contiguous().view(torch.int32)
    toward_zero = (bits & -65536).view(torch.float32)
    away = ((bits & -65536) + 65536).view(torch.float32)
    got = got_bf16.float()
    return ((got == toward_zero) | (got == away) | (got == want_fp32)).all().item()


def e4m3_stochastic_neighbours(q, scale, want_fp32, rel: float = 1e-6):
    """An e4m3 first moment (q [n], block scales [ceil(n/256)], backends/fp8_moment.py) against the fp32 values
    it stores: every block's scale is the one its fp32 maxima call for, and every stored value is one of the
    two e4m3 grid points around its fp32 value (``rel``: the slack for want coming from a different fp32
    operation order). Returns a list of what failed (empty when all holds)."""
    from llmq_ray.backends import fp8_moment

    want = want_fp32.float().reshape(-1)
    n = want.numel()
    blocks = torch.nn.functional.pad(want, (0, fp8_moment.num_blocks(n) * 256 - n)).view(-1, 256)
    bad = []
    if not torch.equal(scale, fp8_moment.block_scales(blocks.abs().amax(dim=1))):
        bad.append("block scales differ from those of the fp32 maxima")
    s = scale.repeat_interleave(256)[:n]
    y = want / s  # exact: s is a power of two
    a = y.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    step = torch.where(a >= 2.0 ** -6, torch.exp2(exp - 3), torch.full_like(a, 2.0 ** -9))
    got = q.float()
    lo = torch.floor(y / step) * step  # the grid point at or below y (exact: step is a power of two)
    slack = rel * a + 1e-30
    ok = ((got - lo).abs() <= slack) | ((got - (lo + step)).abs() <= slack)
    if not ok.all():
        i = int((~ok).nonzero()[0])
        bad.append(f"element {i}: stored {got[i].item()} is not a grid neighbour of {y[i].item()} (step {step[i].item()})")
    return bad


def fp8_layer_copy_gib(engine, layers: int) -> float:
    """GiB of the FP8 weight copies (both layouts, one byte per element) of the first ``layers`` layers' block
    matrices of ``engine`` (a TrainEngine): a --kept-quants-gib that keeps exactly those layers."""
    lin = engine.model.lin
    return sum(2 * lin.shapes[key][0] * lin.shapes[key][1] for key, (layer, _) in lin.layer_of.items()
               if layer < layers) / 2**30


def spawn_gloo_ranks(args_of, target, world: int, timeout_s: float = 180) -> None:
    """Run ``target(*args_of(rank, port))`` in ``world`` spawned processes that form one process group at
    ``port`` (gloo; or NCCL when the target joins one on a GPU); all must exit 0. A hang (mismatched collectives)
    fails the test instead of leaving processes behind."""
    import multiprocessing

    from llmq_ray.actors.collectives import free_port

    ctx = multiprocessing.get_context("spawn")
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=args_of(r, port)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """This spawned process as gloo rank ``rank`` of ``world`` (one CPU thread); the group is left on exit."""
    torch.set_num_threads(1)
    from llmq_ray.actors.collectives import destroy_group, init_group

    comm = init_group(f"tcp://127.0.0.1:{port}", rank, world, torch.device("cpu"), timeout_s=60)
    try:
        yield comm
    finally:
        destroy_group()


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEFAULT_SYSTEM = "You are a helpful assistant."
# our own ChatML template: Qwen's layout (default system prompt, ChatML turns, generation prompt); roles other
# than system/user/assistant are refused by the template itself
TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- else %}{{- raise_exception('role ' + message['role'] + ' is not supported') }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_chatml_tokenizer(folder) -> str:
    """A tiny byte-level BPE tokenizer (< 512 ids, so the ``tiny`` preset reads it) with its own ChatML chat
    template in the layout of Qwen's (default system prompt, generation prompt), written into ``folder`` as an
    HF tokenizer folder (tokenizer.json, tokenizer_config.json); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. user assistant system "
                             "You are a helpful assistant.\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False} for s in SPECIALS}
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "added_tokens_decoder": added, "chat_template": TEMPLATE}, f)
    assert tok.get_vocab_size() <= 512
    return str(folder)


def our_model_from_hf(hf_model, tmp_path, batch: int, seq: int, dtype=torch.float32, **kwargs):
    """Our model (torch reference backend) with the weights of transformers model ``hf_model``, through a
    save_pretrained folder in ``tmp_path`` and our HF loader."""
    from llmq_ray.backends import get_backend
    from llmq_ray.model.config import config_from_hf_dict
    from llmq_ray.model.hf_io import load_hf_weights
    from llmq_ray.model import build_model

    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder)
    cfg = config_from_hf_dict(hf_model.config.to_dict())
    model = build_model(cfg, get_backend("torch"), batch=batch, seq=seq, dtype=dtype, **kwargs)
    load_hf_weights(str(folder), model.layout, model.params)
    return model


def random_batch(vocab: int, batch: int, seq: int, seed: int = 1):
    """Random (inputs, targets) [batch, seq] with a few masked targets, which must count neither in the loss
    nor in its denominator."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[0, 3] = -100
    targets[1, 10:13] = -100
    return inputs, targets


def trainer_from_cli(argv: list[str], **overrides):
    """The LLMQTrainer that ``examples/train.py ARGV`` (the command line) builds, made in this process -- so it
    runs on the test session's Ray instead of starting and stopping a Ray of its own (~10 s per run on the
    2-core CI machine). ``overrides``: keyword arguments that replace the parsed ones (e.g. short timeouts)."""
    from llmq_ray.train import cli
    from llmq_ray.train.trainer import LLMQTrainer

    return LLMQTrainer(cli=True, **{**cli.trainer_kwargs(cli.build_parser().parse_args(argv)), **overrides})



def exit_after(fn, *args) -> None:
    """The target of a spawned GPU test process: ``fn(*args)``, then exit at once with its status (a traceback
    printed on failure). The process group is not destroyed: after NCCL collectives were captured into CUDA graphs
    that waits forever (see actors/collectives.py: destroy_group), and os._exit skips it either way."""
    import os
    import sys
    import traceback

    code = 1
    try:
        fn(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - reported, and the exit status fails the test
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# the run the engine-level tests describe unless they say otherwise: a tiny model, fp32, from scratch, no warmup
ENGINE_TEST_DEFAULTS = dict(model="tiny", batch_size=4, seq_len=256, steps=100, learning_rate=3e-4, warmup=0,
                            model_dtype="fp32", from_scratch=True)


def train_settings(_base=None, **overrides):
    """A ``RunSettings`` for building an engine in a test: ``ENGINE_TEST_DEFAULTS`` under ``overrides`` (keywords
    routed by name, as ``LLMQTrainer`` routes them). The "auto" values the trainer would resolve stay "auto",
    which the engine reads as their plain meaning (the LM head in the model dtype, the current SwiGLU scale,
    FP8 weight copies persistent below ZeRO-3); ``_base``: settings to start from instead."""
    from llmq_ray.settings import make_settings

    if _base is not None:
        return make_settings(_base, **overrides)
    return make_settings(**{**ENGINE_TEST_DEFAULTS, **overrides})


def checked_settings(**overrides):
    """``train_settings`` through every rule (llmq_ray/settings/rules.py): what ``checked_settings(...)``
    was."""
    from llmq_ray.settings.rules import validate

    return validate(train_settings(**overrides))


@contextlib.contextmanager
def injected_fault(monkeypatch, fault):
    """The test hook of actors/fault_injection.py for the runs started inside the block: ``fault`` (a dict or a
    list of dicts) as JSON in LLMQ_RAY_TEST_FAULT, which the trainer reads at start."""
    monkeypatch.setenv("LLMQ_RAY_TEST_FAULT", json.dumps(fault))
    try:
        yield
    finally:
        monkeypatch.delenv("LLMQ_RAY_TEST_FAULT", raising=False)


def faulty_trainer(fault=None, **kwargs):
    """``LLMQTrainer(**kwargs)`` whose run meets ``fault`` (actors/fault_injection.py; None: no fault) -- the
    test hook travels in the run's plan, set here where the trainer builds it, as LLMQ_RAY_TEST_FAULT sets it for
    runs started as a command."""
    from llmq_ray.train.trainer import LLMQTrainer

    class FaultyTrainer(LLMQTrainer):
        def _build_plan(self, ray):
            plan = super()._build_plan(ray)
            plan.fault = fault
            return plan

    return FaultyTrainer(**kwargs)


def make_plan(world_size: int = 1, **overrides):
    """A ``RunPlan`` of ``world_size`` workers over ``train_settings(**overrides)`` (placement checks in tests)."""
    from llmq_ray.actors.plan import RunPlan

    return RunPlan(settings=train_settings(**overrides), world_size=world_size)
