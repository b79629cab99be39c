"""Text <-> token ids for the server: prompts, chat templates, and the context-length checks.

One lock guards the tokenizer: request handlers (thread pool) and the model worker share it, and
fast tokenizers are not safe to call from two threads at once.
"""

from __future__ import annotations

import threading

from kvstrata.serve.errors import APIError
from kvstrata.serve.tokens import SegmentTokenizer

#: no tokenizer here averages this many bytes per token: longer text cannot fit the context, and is
#: refused before it is tokenized (tokenizing megabytes would stall the worker, which shares the lock)
MAX_BYTES_PER_TOKEN = 64


class Prompts:
    def __init__(self, tokenizer, context: int, vocab: int):
        self.tok, self.context, self.vocab = tokenizer, context, vocab
        self._lock = threading.Lock()
        self.tokens = SegmentTokenizer(tokenizer)  # a conversation's earlier turns are not tokenized again

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt as `kvstrata generate` tokenizes it (with the tokenizer's special tokens)."""
        if isinstance(prompt, list):
            bad = next((t for t in prompt if not 0 <= t < self.vocab), None)
            if bad is not None:
                raise APIError(
                    400, f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab})", param="prompt"
                )
            return self._checked(list(prompt), "prompt")
        self._fits(len(prompt.encode()), "prompt")
        with self._lock:
            return self._checked(self.tokens.ids_with_specials(prompt), "prompt")

    def chat_ids(self, messages) -> list[int]:
        """Messages through the tokenizer's chat template, with the assistant's turn opened."""
        if not getattr(self.tok, "chat_template", None):
            raise APIError(
                400, "this model's tokenizer has no chat template: use /v1/completions with a prompt",
                param="messages", code="no_chat_template",
            )
        convo = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages
        ]
        self._fits(sum(len(m["content"].encode()) for m in convo), "messages")
        with self._lock:
            try:
                text = self.tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # the template's own checks (e.g. roles must alternate) raise
                raise APIError(
                    400, f"messages: the chat template refused them: {e}", param="messages"
                ) from None
            return self._checked(self.tokens.ids(text), "messages")

    def _fits(self, nbytes: int, param: str) -> None:
        if nbytes > self.context * MAX_BYTES_PER_TOKEN:
            raise APIError(
                400,
                f"the prompt is {nbytes} bytes: far more than this model's context of {self.context} tokens "
                "can hold",
                param=param,
                code="context_length_exceeded",
            )

    def _checked(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(ids) >= self.context:
            raise APIError(
                400,
                f"the prompt is {len(ids)} tokens; this model's context is {self.context} tokens (the "
                "prompt must leave room for at least one new token)",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    def max_tokens(self, prompt_tokens: int, asked: int | None, default: int) -> int:
        """Tokens this request may generate: as asked (400 if it does not fit), else the default."""
        room = self.context - prompt_tokens
        if asked is None:
            return min(default, room)
        if asked > room:
            raise APIError(
                400,
                f"max_tokens: {asked} new tokens after a {prompt_tokens}-token prompt exceed this model's "
                f"context of {self.context} tokens (at most {room} fit)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return asked

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self.tok.decode(ids, skip_special_tokens=True)

    def eos_ids(self, model) -> set[int]:
        """Token ids that end a generation: the tokenizer's EOS and the model's generation config's."""
        ids = {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos} if eos is not None else set()
        return ids
