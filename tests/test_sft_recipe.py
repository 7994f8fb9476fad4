"""The fine-tune recipe of the README, end to end on CPU: chat JSONL -> masked shards with the model's own chat
template -> fine-tuning an HF folder's weights (not from scratch) through the CLI -> an HF export that
transformers loads, with the tokenizer and its chat template beside the weights."""

import json
import shutil

import torch

from _helpers import TEMPLATE, write_chatml_tokenizer

from llmq_ray.data_pipeline.tokenize import main as tokenize_main
from llmq_ray.observe.runlog import read_log
from llmq_ray.train import cli

REPLIES = ["The quick brown fox.", "The lazy dog jumps over the fox.", "A brown dog."]


def test_fine_tune_recipe_runs_end_to_end(ray_cluster, tmp_path):
    import transformers

    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    write_chatml_tokenizer(model_dir)  # the "downloaded" model's tokenizer and chat template
    hf_cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      tie_word_embeddings=True, max_position_embeddings=256,
                                      architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    start = transformers.Qwen2ForCausalLM(hf_cfg)
    start.save_pretrained(model_dir)
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i in range(90):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What jumps {i % 3}?"},
                                             {"role": "assistant", "content": REPLIES[i % 3]}]}) + "\n")
    data = tmp_path / "data"
    assert tokenize_main(["--chat", str(chat), "--tokenizer", str(model_dir), "--out", str(data),
                          "--eval-tokens", "256", "--no-progress"]) == 0
    assert json.loads((data / "meta.json").read_text())["masked"] is True

    log, out = tmp_path / "log.jsonl", tmp_path / "out"
    rc = cli.main(["--model", str(model_dir), "--train-file", str(data / "train-*.bin"),
                   "--eval-file", str(data / "eval.bin"), "--device", "cpu", "--workers", "1", "--steps", "25",
                   "--batch-size", "4", "--seq-len", "32", "--learning-rate", "3e-3", "--warmup", "2",
                   "--out-dir", str(out), "--log-file", str(log), "--sample-tokens", "0", "--no-progress",
                   "--no-ray-data", "--export-dtype", "fp32"])
    assert rc == 0
    records = read_log(str(log))
    losses = [r["loss"] for r in records if r.get("log") == "step"]
    assert len(losses) == 25 and sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    # only assistant tokens were targets: a window of 32 tokens holds far fewer than 32 of them
    assert all(r["targets"] < 4 * 32 for r in records if r.get("log") == "step")

    export = out / "export"
    tuned = transformers.AutoModelForCausalLM.from_pretrained(export)
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "What jumps 1?"}], add_generation_prompt=True,
                                     return_tensors="pt")
    prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    with torch.no_grad():
        before = start(prompt).logits[0, -1].log_softmax(-1)
        after = tuned(prompt).logits[0, -1].log_softmax(-1)
    first = tok.encode(REPLIES[1])[0]  # the reply it was tuned on starts far likelier than before
    assert after[first] > before[first] + 1.0, (after[first].item(), before[first].item())
    shutil.rmtree(out, ignore_errors=True)
