"""Incremental detokenization and stop-string checking for one request, and a token's bytes.

Text comes from `tokenizers.decoders.DecodeStream`, which re-decodes only a short window of
recent tokens and emits text once it is valid UTF-8, so characters split over tokens and
pieces that merge across token boundaries come out as the full decode would have them.

A token alone may hold part of a character, which decodes to U+FFFD: `TokenBytes` gives its
bytes from the vocabulary instead (OpenAI's logprobs `bytes`), so the bytes of a completion's
tokens join into its UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

from engine.request import SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

# Prompt tokens the stream is primed with: enough context for a first output token's leading
# space or merge, without decoding the whole prompt.
_NUM_PRIMING_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a request's sampled tokens into text and finds its stop strings.

    `output_text` is only ever cut at a stop string, and `get_next_output_text` never releases
    text that a stop string could still begin in, so what was emitted is never taken back.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | Tokenizer,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | None = None,
    ) -> None:
        """Start a request; `output_token_ids` resumes one whose text up to them was emitted."""
        self.tokenizer: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.token_ids: list[int] = []  # every token passed to update, as CompletionOutput has
        self._text = ""
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        for token_id in prompt_token_ids[-_NUM_PRIMING_TOKENS:]:
            self._stream.step(self.tokenizer, token_id)
        # Resume: rebuild the text, then mark as sent exactly what the previous owner sent
        # (it cannot have completed a stop string, or the request would have finished).
        for token_id in output_token_ids or ():
            self._decode_next(token_id)
        self._last_output_text_offset = len(self._text) - self._num_held_back_chars()

    @property
    def output_text(self) -> str:
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append sampled tokens and decode them; return the stop string they complete, if any.

        On a match the text is cut at the stop string (kept through it with
        `include_stop_str_in_output`) and tokens after the completing one are dropped.
        `stop_terminated` means the last token is an EOS / stop token id that finishes the
        request: its text is left out unless `include_stop_str_in_output`, as in vLLM.
        """
        for i, token_id in enumerate(new_token_ids):
            is_stop_token = stop_terminated and i == len(new_token_ids) - 1
            if is_stop_token and not self.include_stop_str_in_output:
                self.token_ids.append(token_id)
                return None
            offset_before = len(self._text)
            self._decode_next(token_id)
            if self.stop and not is_stop_token:
                stop_str = self._check_stop_strings(offset_before)
                if stop_str is not None:
                    return stop_str
        return None

    def _decode_next(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._text += self._stream.step(self.tokenizer, token_id) or ""

    def _check_stop_strings(self, offset_before: int) -> str | None:
        """Find the stop string that completes first in the text added after `offset_before`
        and cut the text there. Only a match ending in the new text can be new."""
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = self._text.find(stop_str, max(0, offset_before - len(stop_str) + 1))
            if start != -1:
                match = (start + len(stop_str), start, stop_str)
                best = match if best is None else min(best, match)
        if best is None:
            return None
        end, start, stop_str = best
        self._text = self._text[: end if self.include_stop_str_in_output else start]
        return stop_str

    def _num_held_back_chars(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string.

        With `include_stop_str_in_output` nothing is held: a match is emitted whole anyway.
        """
        if self.include_stop_str_in_output:
            return 0
        longest = 0
        for stop_str in self.stop:
            for n in range(min(len(stop_str) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop_str[:n]):
                    longest = n
                    break
        return longest

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text not sent yet (`delta`) or all of it, short of a possible stop-string start
        unless `finished`. With `delta`, what is returned counts as sent."""
        length = len(self._text)
        if not finished:
            length -= self._num_held_back_chars()
        if not delta:
            return self._text[:length]
        last_offset = self._last_output_text_offset
        if length <= last_offset:
            return ""
        self._last_output_text_offset = length
        return self._text[last_offset:length]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte in a vocabulary
    (printable Latin-1 as itself, the other bytes as U+0100 onwards), mapped back to it."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback pieces


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    if decoder is None:
        return []
    if decoder["type"] == "Sequence":
        return [step for d in decoder["decoders"] for step in _decoder_steps(d)]
    return [decoder]


class TokenBytes:
    """Token id -> the bytes it stands for in the vocabulary (cached per id).

    Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) writes each byte as one character of its
    alphabet; sentencepiece-style vocabularies (Llama 2, Mistral) hold text with U+2581 for
    a space and `<0xNN>` pieces for bytes (byte fallback). Which one a tokenizer is comes from
    its decoder. Added tokens (`<|im_end|>`) are their text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | Tokenizer) -> None:
        backend: Tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        steps = _decoder_steps(json.loads(backend.to_str())["decoder"])
        kinds = {step["type"] for step in steps}
        self._backend = backend
        self._added = {i: t.content.encode() for i, t in backend.get_added_tokens_decoder().items()}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = [
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step["type"] == "Replace" and "String" in step["pattern"]
        ] + [(step["replacement"], " ") for step in steps if step["type"] == "Metaspace"]
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id]
        piece = self._backend.id_to_token(token_id)
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if self._byte_fallback and (match := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(match[1], 16)])
        for pattern, content in self._replacements:
            piece = piece.replace(pattern, content)
        return piece.encode()
