"""Incremental detokenization and stop-string checking for one request.

Text comes from `tokenizers.decoders.DecodeStream`, which re-decodes only a short window of
recent tokens and emits text once it is valid UTF-8, so characters split over tokens and
pieces that merge across token boundaries come out as the full decode would have them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
