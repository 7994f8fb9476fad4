"""--document-masking: in a window packing several documents, attention stops at each document's end.

The exact check: a window of 3 documents gives the losses and every gradient of the 3 documents run one by one
(fp32; the only differences are rounding: RoPE sees other absolute positions, the sums run over other lengths).
"""

import json

import numpy as np
import pytest
import torch

from llmq_ray.backends import get_backend
from llmq_ray.backends.attention import MASKED_SCORE_BIAS
from llmq_ray.data_pipeline.shards import write_shard
from llmq_ray.engine.train_engine import TrainEngine
from llmq_ray.errors import ConfigError
from llmq_ray.model.config import PRESETS
from llmq_ray.model import build_model
from llmq_ray.model.build import Recompute
from _helpers import checked_settings, train_settings
from llmq_ray.train.preflight import data_eos_id, separator_seen

EOS = 7
CFG = PRESETS["tiny-qwen3"]  # QK-norm and head_dim != hidden / heads: the widest attention path we have


def _documents(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(10, CFG.vocab_size, (n,), generator=gen), torch.tensor([EOS])])
            for n in lengths]


def _loss_and_grads(rows_in, rows_tgt, separator, recompute=None, cfg=CFG, attention="sdpa"):
    """Sum of target losses and the gradient of it, for a batch of equal-length rows."""
    inputs, targets = torch.stack(rows_in), torch.stack(rows_tgt)
    model = build_model(cfg, get_backend("torch", attention=attention), batch=inputs.shape[0],
                       seq=inputs.shape[1],
                       separator=separator, recompute=recompute,
                       restart_positions=cfg.is_gpt2 and separator is not None)
    torch.manual_seed(1)
    model.params.normal_(0.0, 0.08)
    model.zero_grads()
    model.forward_backward(inputs, targets)
    return model.loss_sum.item(), model.grads.clone()


def _packed(docs):
    window = torch.cat(docs)
    inputs, targets = window[:-1].clone(), window[1:].clone()
    targets[inputs == EOS] = -100  # the next document's first token has no counterpart in a run alone
    return inputs, targets


@pytest.mark.parametrize("recompute, cfg, attention", [(None, CFG, "sdpa"), (Recompute(block=True), CFG, "sdpa"),
                                                      (None, PRESETS["tiny-gpt2"], "sdpa"), (None, CFG, "deterministic")],
                         ids=["stored", "recomputed", "gpt2-reset-positions", "triton-backward"])
def test_a_packed_window_equals_its_documents_run_alone(recompute, cfg, attention):
    """(GPT-2: with --reset-positions, its learned positions restart at each document. "triton-backward": the
    packed window's attention backward through the tile-skipping Triton kernel, under the interpreter.)"""
    docs = [_documents((9, 14, 8)), _documents((5, 20, 6), seed=3)]   # two rows, 34 tokens each
    packed = [_packed(d) for d in docs]
    loss, grads = _loss_and_grads([p[0] for p in packed], [p[1] for p in packed], EOS, recompute, cfg, attention)
    alone_loss, alone_grads = 0.0, torch.zeros_like(grads)
    for doc in docs[0] + docs[1]:
        l, g = _loss_and_grads([doc[:-1]], [doc[1:]], EOS, cfg=cfg)
        alone_loss += l
        alone_grads += g
    assert abs(loss - alone_loss) <= 1e-5 * alone_loss, (loss, alone_loss)
    err = (grads - alone_grads).abs().max() / alone_grads.abs().max()
    assert err <= 1e-5, f"max relative gradient difference {err:.2e}"
    # and without the masking the same window is a different computation (the test can fail)
    unmasked, unmasked_grads = _loss_and_grads([p[0] for p in packed], [p[1] for p in packed], None, cfg=cfg)
    assert abs(unmasked - alone_loss) > 1e-5 * alone_loss
    assert (unmasked_grads - alone_grads).abs().max() / alone_grads.abs().max() > 1e-3


def test_engine_trains_with_document_masking_and_takes_the_model_eos_by_default():
    opts = train_settings(model="tiny", batch_size=2, seq_len=32, learning_rate=3e-3, seed=1, document_masking=True)
    e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"))
    assert e.model.build.separator == PRESETS["tiny"].eos_token_id
    doc = torch.cat([torch.arange(10) % 5 + 20, torch.tensor([PRESETS["tiny"].eos_token_id])])
    x = doc.repeat(3)[:33].repeat(2, 1)
    losses = []
    for step in range(8):
        e.micro_step(x[:, :-1], x[:, 1:], last=True)
        losses.append(e.update(3e-3, step + 1).loss)
    assert losses[-1] < 0.7 * losses[0], losses


def test_document_masking_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="--document-separator=-1"):
        checked_settings(document_masking=True, document_separator=-1)
    with pytest.raises(ConfigError, match="--document-separator=True must be an integer, not bool"):
        checked_settings(document_masking=True, document_separator=True)
    with pytest.raises(ConfigError, match=r"--document-separator=5 needs --document-masking"):
        checked_settings(document_separator=5)
    from llmq_ray.train.model_checks import check_model_settings

    with pytest.raises(ConfigError, match="with GPT-2 needs --reset-positions"):
        check_model_settings(PRESETS["tiny-gpt2"], train_settings(model="tiny-gpt2", document_masking=True))
    with pytest.raises(ValueError, match="learned positions needs them reset"):
        build_model(PRESETS["tiny-gpt2"], get_backend("torch"), batch=1, seq=8, separator=0)
    with pytest.raises(ConfigError, match="--reset-positions needs --document-masking"):
        checked_settings(reset_positions=True)


@pytest.mark.parametrize("n_q, n_kv, lengths", [(4, 2, ((5, 20, 30, 9), (64,))), (2, 2, ((1, 16, 15, 17, 15), (33, 31))),
                                                (3, 1, ((40, 24), (16, 16, 16, 16))), (2, 1, ((7, 30, 23), (1, 59)))])
@pytest.mark.parametrize("tiles", ["16x16", "uneven"])
def test_the_tile_skipping_triton_kernels_equal_the_exact_masked_math(n_q, n_kv, lengths, tiles):
    """The Triton forward (out, lse) and backward (the GPU's under document masking; the backward is also
    --deterministic-attention's), under the interpreter in fp32, with 16-token tiles and with uneven ones (16
    queries x 32 keys, and 32 x 16): documents ending inside a tile, on tile edges, one per row, a one-token
    document, GQA groups of 1, 2, 3, T = 64 and T = 60 (partial edge tiles); tiles wholly live (no mask computed) and cut by the diagonal or a document
    end. out, lse, dq, dk, dv equal the exact masked math's within 1e-5 (relative to the largest); without the mask
    the backward equals the plain causal math, and differs from the masked one (the test can fail)."""
    from llmq_ray.backends.attention import DocumentMask, SdpaAttention
    from llmq_ray.backends.triton import attention_bwd, attention_fwd

    b, t, d = len(lengths), sum(lengths[0]), 8  # T = 64, or 60 (no multiple of the tiles: the edge tiles)
    segments = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], dtype=torch.int32)
    mask = DocumentMask(segments)
    mask.refresh()
    gen = torch.Generator().manual_seed(n_q)
    qkv = torch.randn(b, t, n_q + 2 * n_kv, d, generator=gen)
    dout = torch.randn(b, t, n_q, d, generator=gen)
    exact = SdpaAttention(torch.device("cpu"))
    out, lse = torch.empty(b, t, n_q, d), torch.empty(b, n_q, t)
    exact.forward(out, lse, qkv, n_q, n_kv, mask)
    want = torch.empty_like(qkv)
    exact.backward(want, dout, out, lse, qkv, n_q, n_kv, mask)
    fwd_tiles, bwd_tiles = (None, None) if tiles == "16x16" else ((16, 32, 4, 1), ((16, 32, 4, 1), (32, 16, 4, 1)))
    fwd_out, fwd_lse = torch.empty_like(out), torch.empty_like(lse)
    attention_fwd.attention_forward(fwd_out, fwd_lse, qkv, n_q, n_kv, mask, tiles=fwd_tiles)
    assert ((fwd_out - out).abs().max() / out.abs().max()).item() <= 1e-5
    assert (fwd_lse - lse).abs().max().item() <= 1e-5 * lse.abs().max().item()
    got = torch.empty_like(qkv)
    attention_bwd.attention_backward(got, dout, out, lse, qkv, n_q, n_kv, mask, tiles=bwd_tiles)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"max relative difference {err:.2e}"
    unmasked = torch.empty_like(qkv)  # the mask matters here: without it the kernel computes something else
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    exact.forward(out2, lse2, qkv, n_q, n_kv, None)
    attention_bwd.attention_backward(unmasked, dout, out2, lse2, qkv, n_q, n_kv, None, tiles=bwd_tiles)
    plain = torch.empty_like(qkv)
    exact.backward(plain, dout, out2, lse2, qkv, n_q, n_kv, None)
    assert ((unmasked - plain).abs().max() / plain.abs().max()).item() <= 1e-5
    assert (unmasked - got).abs().max() > 1e-2


def test_document_bounds_for_the_tile_skipping():
    from llmq_ray.backends.attention import DocumentMask

    mask = DocumentMask(torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]], dtype=torch.int32))
    mask.refresh()
    assert mask.starts.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6, [0, 1, 2, 3, 4, 5]]
    assert mask.ends.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6, [1, 2, 3, 4, 5, 6]]
    part = mask.rows(slice(1, 3))
    assert part.starts.tolist() == mask.starts[1:].tolist() and part.ends.is_contiguous()


class _FakeCudnn:
    """Stands in for backends/_aten_attention.py (CUDA only): records the score bias the fused path is given."""

    def __init__(self):
        self.biases = []

    def forward(self, out, lse, qkv, n_q, n_kv, bias=None):
        self.biases.append(bias)

    def backward_parts(self, dout, out, lse, qkv, n_q, n_kv, bias=None):
        self.biases.append(bias)
        b, t, _, d = qkv.shape
        return (torch.zeros(b, t, n_q, d, dtype=qkv.dtype), torch.zeros(b, t, n_kv, d, dtype=qkv.dtype),
                torch.zeros(b, t, n_kv, d, dtype=qkv.dtype))


class _FakeTriton:
    """Stands in for backends/triton/attention_fwd.py and attention_bwd.py on the faked GPU path: records the
    DocumentMask each call gets."""

    def __init__(self):
        self.calls = []

    def attention_forward(self, out, lse, qkv, n_q, n_kv, documents):
        self.calls.append(("forward", documents))

    def attention_backward(self, dqkv, dout, out, lse, qkv, n_q, n_kv, documents):
        self.calls.append(("backward", documents))
        dqkv.zero_()


def _model_on_a_faked_gpu(kernels):
    be = get_backend("torch")
    be.attention._aten = _FakeCudnn()  # as on CUDA: bf16 goes to the fused path
    be.attention.DOCUMENT_KERNELS = kernels
    fake_triton = _FakeTriton()
    be.attention._triton = (fake_triton, fake_triton)
    model = build_model(CFG, be, batch=2, seq=6, dtype=torch.bfloat16, separator=EOS,
                       attention_chunks=2)
    return model, be.attention._aten, fake_triton


def _bias_of(seg):
    return torch.where(seg[:, None, :, None] == seg[:, None, None, :], 0.0, MASKED_SCORE_BIAS).bfloat16().float()


def test_on_the_gpu_the_tile_skipping_triton_kernels_get_the_documents_and_no_bias_is_made():
    """The bf16 GPU path (faked here), by default: every layer's forward and each chunk of the backward get the
    model's DocumentMask (its rows, per chunk) with segment ids and bounds rebuilt at every forward; cuDNN is
    never called and no [B, 1, T, T] bias exists."""
    model, cudnn, triton_kernels = _model_on_a_faked_gpu("triton")
    assert model.documents.bias is None
    model._forward_trunk(torch.tensor([[3, EOS, 4, 5, EOS, 6], [3, 4, 5, 6, 8, 9]]).reshape(-1))
    assert [c[0] for c in triton_kernels.calls] == ["forward"] * CFG.num_layers and cudnn.biases == []
    assert all(c[1] is model.documents for c in triton_kernels.calls)
    assert model.documents.starts.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    triton_kernels.calls.clear()
    model._forward_trunk(torch.tensor([[3, 4, 5, 6, 8, 9], [EOS] * 6]).reshape(-1))  # the next micro-step's inputs
    assert model.documents.segments.tolist() == [[0] * 6, [0, 1, 2, 3, 4, 5]]
    assert model.documents.ends.tolist() == [[6] * 6, [1, 2, 3, 4, 5, 6]]
    triton_kernels.calls.clear()
    model.attention.backward(model.d_qkv, model.d_att, model.acts.get("att", 0), model.acts.get("lse", 0),
                             model.acts.get("qkv", 0))
    rows = [c[1] for c in triton_kernels.calls]
    assert [c[0] for c in triton_kernels.calls] == ["backward"] * 2 and cudnn.biases == []
    for name in ("segments", "starts", "ends"):
        assert torch.equal(torch.cat([getattr(r, name) for r in rows]), getattr(model.documents, name))


def test_with_cudnn_kernels_the_fused_path_gets_a_score_bias_built_from_the_segments_on_the_device():
    """DOCUMENT_KERNELS = "cudnn" (faked GPU): the model's DocumentMask carries a [B, 1, T, T] bias, 0 inside a
    document and MASKED_SCORE_BIAS across (the causal part is cuDNN's own flag), rebuilt at every forward from that
    forward's inputs, and the chunked backward hands each chunk its rows of it."""
    model, fake, _ = _model_on_a_faked_gpu("cudnn")
    assert model.documents.bias.shape == (2, 1, 6, 6) and model.documents.bias.dtype == torch.bfloat16
    model._forward_trunk(torch.tensor([[3, EOS, 4, 5, EOS, 6], [3, 4, 5, 6, 8, 9]]).reshape(-1))
    assert torch.equal(model.documents.bias.float(), _bias_of(torch.tensor([[0, 0, 1, 1, 1, 2], [0] * 6])))
    assert all(b is model.documents.bias for b in fake.biases) and len(fake.biases) == CFG.num_layers
    model._forward_trunk(torch.tensor([[3, 4, 5, 6, 8, 9], [EOS] * 6]).reshape(-1))  # the next micro-step's inputs
    assert torch.equal(model.documents.bias.float(), _bias_of(torch.tensor([[0] * 6, [0, 1, 2, 3, 4, 5]])))
    fake.biases.clear()
    model.attention.backward(model.d_qkv, model.d_att, model.acts.get("att", 0), model.acts.get("lse", 0),
                             model.acts.get("qkv", 0))
    assert [tuple(b.shape) for b in fake.biases] == [(1, 1, 6, 6)] * 2
    assert torch.equal(torch.cat(fake.biases), model.documents.bias)
    plain = get_backend("torch").attention_document_mask(torch.zeros(2, 6, dtype=torch.int32), torch.bfloat16)
    assert plain.bias is None  # no fused kernel (CPU): the exact path masks by segment id, no bias made
    with pytest.raises(ValueError, match="needs the DocumentMask's bias"):
        model.backend.attention_forward(torch.empty(2, 6, 1, 8, dtype=torch.bfloat16), torch.empty(2, 1, 6),
                                        torch.zeros(2, 6, 3, 8, dtype=torch.bfloat16), 1, 1, plain)


def test_the_separator_comes_from_the_data_meta_json(tmp_path):
    write_shard(str(tmp_path / "train-000.bin"), np.array([5, 6, 9, 5], dtype=np.int32), 512)
    pattern = str(tmp_path / "train-*.bin")
    assert data_eos_id(pattern) is None
    (tmp_path / "meta.json").write_text(json.dumps({"eos_id": 151643}))
    assert data_eos_id(pattern) == 151643
    assert data_eos_id(str(tmp_path / "nothing-*.bin")) is None
    # the fallback to the model's EOS is refused when that token never ends a document in the data
    assert separator_seen(pattern, 9) is True and separator_seen(pattern, 0) is False


def _zero_batch(step: int, micro: int):
    """[2, 16] inputs/targets of the tiny preset with its EOS inside every row (documents of 6, 6 and 4 inputs, a
    separator ending each of the first two)."""
    gen = torch.Generator().manual_seed(1000 * step + micro)
    eos = PRESETS["tiny"].eos_token_id
    x = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 17), generator=gen)
    x[x == eos] = eos + 1  # no separator but the two placed below
    x[:, 5] = x[:, 11] = eos
    return x[:, :-1], x[:, 1:]


def _zero_rank(rank: int, port: int, out_path: str) -> None:
    """One of 2 gloo ranks: ZeRO-3 with --document-masking, 3 steps of one micro-batch each (rank r takes
    micro-batch r of the one-process run's 2); rank 0 saves the losses and the gathered weights."""
    from _helpers import gloo_group

    with gloo_group(rank, 2, port) as comm:
        opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=1, zero_level=3,
                            document_masking=True, grad_clip=0.0)
        e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"), comm)
        losses = []
        for step in range(3):
            e.micro_step(*_zero_batch(step, rank))
            losses.append(e.update(2e-3, step + 1).loss)
        params = e.full_params()
        if rank == 0:
            torch.save((losses, params), out_path)


def test_document_masking_under_zero3_on_two_gloo_ranks_equals_one_process(tmp_path):
    """ZeRO-3 shards the weights and gathers each layer before use; the document masks are per micro-batch and
    need nothing from it. 2 gloo ranks (ZeRO-3, 1 micro-step each) == 1 process (ZeRO-1, 2 micro-steps) on the
    same micro-batches with --document-masking: losses and final weights within 1e-5 relative (fp32; the sums
    run in another order), and the masking is on (the unmasked run's losses differ)."""
    from _helpers import spawn_gloo_ranks

    spawn_gloo_ranks(lambda r, port: (r, port, str(tmp_path / "rank0.pt")), _zero_rank, 2)
    dist_losses, dist_params = torch.load(tmp_path / "rank0.pt")

    def one_process(masking: bool):
        opts = train_settings(model="tiny", batch_size=2, seq_len=16, grad_accumulation=2, zero_level=1,
                            document_masking=masking, grad_clip=0.0)
        e = TrainEngine(PRESETS["tiny"], opts, get_backend("torch"))
        losses = []
        for step in range(3):
            for micro in range(2):
                e.micro_step(*_zero_batch(step, micro))
            losses.append(e.update(2e-3, step + 1).loss)
        return losses, e.full_params()

    losses, params = one_process(True)
    np.testing.assert_allclose(dist_losses, losses, rtol=1e-5)
    assert ((dist_params - params).norm() / params.norm()).item() < 1e-5
    unmasked, _ = one_process(False)
    assert abs(unmasked[0] - losses[0]) > 1e-4 * losses[0]


def test_a_separator_that_masks_nothing_is_refused_before_ray(tmp_path):
    """--document-separator outside the model's vocabulary, or absent from the train data, would run as if masking
    were off; the data's meta.json naming a token outside the vocabulary means data of another tokenizer. Each is
    one ConfigError from the trainer's constructor (before Ray; the API's names, the CLI says --document-separator
    and --train-file); a separator that occurs is taken."""
    from llmq_ray.train.trainer import LLMQTrainer

    write_shard(str(tmp_path / "train-000.bin"), np.array([5, 6, 9, 5] * 64, dtype=np.int32), 512)
    kw = dict(model="tiny", device="cpu", train_file=str(tmp_path / "train-*.bin"), batch_size=2, seq_len=16,
              steps=2, out_dir=str(tmp_path / "out"), document_masking=True)
    with pytest.raises(ConfigError, match=r"^document_separator=999999 is not a token id of model tiny \(its "
                                          r"vocabulary has 512 tokens\), so nothing would be masked\.$"):
        LLMQTrainer(document_separator=999999, **kw)
    with pytest.raises(ConfigError, match=r"^document_separator=7 never occurs in the first tokens of "
                                          r"train_file .*train-\*\.bin, so nothing would be masked"):
        LLMQTrainer(document_separator=7, **kw)
    assert LLMQTrainer(document_separator=9, **kw).settings.data.document_separator == 9
    (tmp_path / "meta.json").write_text(json.dumps({"eos_id": 151643}))
    with pytest.raises(ConfigError, match=r"^document_masking: the end-of-document token 151643 named by the "
                                          r"meta\.json .* was the data tokenized for another model\?$"):
        LLMQTrainer(**kw)
    (tmp_path / "meta.json").write_text(json.dumps({"eos_id": 6}))
    assert LLMQTrainer(**kw).settings.data.document_separator == 6
