"""Chat data for supervised fine-tuning: conversations through the model's own chat template, into tokens and a
per-token target mask in which only the assistant's turns are trained on.

Input (``python -m llmq_ray.data_pipeline.tokenize --chat data.jsonl --tokenizer FOLDER --out DIR``): jsonl, one
conversation per line, ``{"messages": [{"role": ..., "content": "..."}, ...]}``; roles are ``system``, ``user``,
``assistant`` (and ``tool``, for templates that render it); a message's other keys (e.g. ``tool_calls``) reach the
template untouched, a line's other keys are ignored. ``FOLDER`` is a Hugging Face tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json``) whose ``chat_template`` (or ``chat_template.jinja``) is the
model's; ``--chat-template FILE`` replaces it.
Rendering and encoding are transformers' own (``AutoTokenizer.from_pretrained(FOLDER).apply_chat_template(...,
tokenize=False)``, then ``encode(text, add_special_tokens=False)``: what ``apply_chat_template(tokenize=True)``
does), so the tokens are exactly those the model sees from that tokenizer at inference.

How the assistant spans are found (prefix rendering; one method for every template, ``{% generation %}`` or not):
for assistant message i,

    P = tokens of render(messages[:i], add_generation_prompt=True)    the prompt, up to "<|im_start|>assistant\\n"
    E = tokens of render(messages[:i+1])                              the prompt and message i, "...<|im_end|>\\n"

and both must be a *token* prefix of the whole conversation's tokens F (else one DataError naming the file and
line, see below). The targets are F[len(P) : len(E)] less the trailing tokens that decode to whitespace only. For
ChatML (Qwen) that is the message's content and its end-of-turn token ``<|im_end|>``: the model must learn to stop,
and generation stops there, so the template's ``"\\n"`` after it is not a target; nor is the role header
``<|im_start|>assistant\\n``, which the generation prompt supplies at inference. With a template that ends a turn
without a marker, the whole delta (less trailing whitespace) is the target.

Output of ``encode``: int32 ids [n] (the conversation, then the separator) and bool mask [n], True where token j
is an assistant token = trained on *as a target* (the label predicted at position j-1), which is exactly the
meaning of the loss-mask bitmap of an llm.q shard (data_pipeline/shards.py). The separator between conversations
(``--eos-id``, else ``<|endoftext|>`` / ``<|end_of_text|>`` when the vocabulary has it, else the tokenizer's
``eos_token``) is never a target, and it must never occur inside a rendered conversation (one DataError
otherwise): it is what ``--document-masking`` cuts windows at, and a template that ends its turns with it (e.g. a
Llama-3 Instruct folder whose eos_token is ``<|eot_id|>``) would cut every conversation into turns. Windows cross
conversation boundaries as in pre-training unless ``--document-masking`` is given.

Bad input is one DataError sentence naming the file and line: not JSON, no ``messages`` list, a message without a
string ``role``/``content``, a role outside the four above, the template raising (e.g. its own
``raise_exception``), or a template that renders earlier turns differently once later turns follow -- the
prefix check then fails: Qwen3's thinking template, which drops the reasoning of earlier assistant turns, is
such a template for multi-turn conversations (write one line per assistant turn instead); so is content whose
first characters merge with the generation prompt's last token (content starting with a newline after
ChatML's ``assistant\\n``). A conversation *without* an assistant turn has nothing to learn from: it is skipped
and counted (meta.json ``chat.skipped_no_assistant``, and the command's summary line), not an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from llmq_ray.errors import DataError

CHAT_ROLES = ("system", "user", "assistant", "tool")
# what the tokenize command records in meta.json["mask_rule"]
MASK_RULE = ("assistant turns (content and end-of-turn token) are targets; bit j of a shard's mask bitmap = "
             "token j as a target")


@dataclass(frozen=True)
class ChatSpec:
    """Picklable construction arguments of a ``ChatTokenizer`` (worker processes rebuild it)."""

    folder: str
    template_file: Optional[str] = None
    eos_id: Optional[int] = None


class ChatTokenizer:
    """An HF tokenizer folder's chat template + tokenizer: ``encode(messages, where)`` -> (ids, mask) or None."""

    def __init__(self, spec: ChatSpec):
        folder = spec.folder
        if not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise DataError(f"{folder}: --chat needs --tokenizer naming a Hugging Face tokenizer folder "
                            f"(tokenizer.json, tokenizer_config.json with the chat template); found none there.")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError("--chat renders conversations with transformers' chat templates; "
                            "pip install transformers.") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # transformers raises many kinds on a broken folder
            raise DataError(f"{folder}: cannot load the tokenizer with transformers "
                            f"({type(e).__name__}: {e}).") from None
        if spec.template_file is not None:
            try:
                with open(spec.template_file, encoding="utf-8") as f:
                    self.tok.chat_template = f.read()
            except OSError as e:
                raise DataError(f"{spec.template_file}: cannot read the chat template ({e.strerror}).") from None
        template = self.tok.chat_template
        if isinstance(template, dict):  # several named templates: the default one renders plain chats
            template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise DataError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                            f"or chat_template.jinja); pass --chat-template FILE.")
        self.template = template
        self.name = f"hf:{os.path.join(folder, 'tokenizer.json')}"
        vocab = self.tok.get_vocab()
        self.vocab_size = max(vocab.values()) + 1
        if spec.eos_id is not None:
            self.eos_id = int(spec.eos_id)
        elif "<|endoftext|>" in vocab or "<|end_of_text|>" in vocab:  # Qwen / Llama 3: between documents
            self.eos_id = vocab.get("<|endoftext|>", vocab.get("<|end_of_text|>"))
        elif self.tok.eos_token_id is not None:
            self.eos_id = int(self.tok.eos_token_id)
        else:
            raise DataError(f"{folder}: cannot tell the token that separates conversations (no <|endoftext|>, "
                            f"no eos_token); pass --eos-id.")
        if not 0 <= self.eos_id < self.vocab_size:
            raise DataError(f"--eos-id {self.eos_id} is outside the vocabulary [0, {self.vocab_size}).")
        self._blank: dict[int, bool] = {}

    # ---- pieces ----------------------------------------------------------------------------------
    def render(self, messages: list, generation_prompt: bool, where: str) -> str:
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja2's TemplateError (raise_exception, undefined), TypeError, ...
            raise DataError(f"{where}: the chat template fails on this conversation "
                            f"({type(e).__name__}: {e}).") from None

    def encode_text(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _is_blank(self, token_id: int) -> bool:
        hit = self._blank.get(token_id)
        if hit is None:
            hit = self._blank[token_id] = self.tok.decode([token_id]).strip() == ""
        return hit

    def _prefix_tokens(self, messages: list, upto: int, generation_prompt: bool, full_text: str, full: list,
                       where: str, turn: int) -> int:
        """len of the tokens of render(messages[:upto]) after checking they are a token prefix of ``full``
        (``turn``: the 1-based number of the assistant message whose span is being found, for the error)."""
        text = self.render(messages[:upto], generation_prompt, where)
        what = (f"the rendering of messages 1-{upto}" if upto else "the rendering of no message") + \
               (" with the generation prompt" if generation_prompt else "")
        if not full_text.startswith(text):
            raise DataError(
                f"{where}: {what} is not a prefix of the whole conversation's rendering (the chat template renders "
                f"earlier turns differently once later turns follow, e.g. it drops earlier reasoning), so the "
                f"assistant tokens of message {turn} cannot be told exactly; write one line per assistant turn.")
        ids = self.encode_text(text)
        if full[:len(ids)] != ids:
            k = next((j for j, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
            raise DataError(
                f"{where}: {what} tokenizes differently from the start of the whole conversation (from token {k}: "
                f"the text at the boundary merges into other tokens, e.g. content starting with whitespace), so "
                f"the assistant tokens of message {turn} cannot be told exactly; strip that whitespace.")
        return len(ids)

    # ---- a conversation ----------------------------------------------------------------------------
    def encode(self, messages: list, where: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(int32 ids [n], bool mask [n]) of the rendered conversation followed by the separator; mask True on
        assistant tokens. None when the conversation has no assistant turn."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            return None
        full_text = self.render(messages, False, where)
        full = self.encode_text(full_text)
        if self.eos_id in full:
            raise DataError(f"{where}: the conversation separator, token {self.eos_id} "
                            f"({self.tok.decode([self.eos_id])!r}), occurs inside the rendered conversation (the "
                            f"template ends turns with it); pass --eos-id with a token the template never emits.")
        mask = np.zeros(len(full) + 1, dtype=bool)
        prev_end = 0
        for i in turns:
            start = self._prefix_tokens(messages, i, True, full_text, full, where, i + 1)
            end = self._prefix_tokens(messages, i + 1, False, full_text, full, where, i + 1)
            while end > start + 1 and self._is_blank(full[end - 1]):
                end -= 1  # the template's separator after the end-of-turn token
            if start < prev_end:
                raise DataError(f"{where}: the chat template renders assistant message {i + 1}'s generation prompt "
                                f"over the end of the previous assistant message, so their tokens cannot be told "
                                f"apart.")
            if end <= start:
                raise DataError(f"{where}: the chat template renders assistant message {i + 1} as no tokens after "
                                f"its generation prompt, so there is nothing to train on in it.")
            mask[start:end] = True
            prev_end = end
        ids = np.asarray(full + [self.eos_id], dtype=np.int32)
        return ids, mask


def iter_conversations(files: list[str]) -> Iterator[tuple[str, list, int]]:
    """Yield (where = "path: line N", messages, source bytes) for every non-blank line of chat jsonl files, in
    order; every malformed line raises one DataError naming the file and line."""
    for path in files:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                try:
                    doc = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{where} is not valid JSON ({getattr(e, 'msg', e)}).") from None
                messages = doc.get("messages") if isinstance(doc, dict) else None
                if not isinstance(messages, list):
                    raise DataError(f"{where} has no \"messages\" list (chat format: "
                                    f"{{\"messages\": [{{\"role\": \"user\", \"content\": \"...\"}}, ...]}}).")
                for k, m in enumerate(messages, 1):
                    if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                            or not isinstance(m.get("content"), str):
                        raise DataError(f"{where}: message {k} is not an object with string \"role\" and "
                                        f"\"content\".")
                    if m["role"] not in CHAT_ROLES:
                        raise DataError(f"{where}: message {k} has role {m['role']!r}, not one the chat template "
                                        f"renders ({', '.join(CHAT_ROLES)}).")
                yield where, messages, len(line)
