"""Generated tokens to text as they arrive: whole characters only, and stop strings cut out.

A character can span several tokens; an incremental UTF-8 decoder holds its first bytes
back until it is complete, so a stream never carries a broken character. Text that could
still turn into a stop string is held back too, and the stop string is never emitted.

A TextStream is also its sequence's stop checker (generate.sequence.StopChecker): the
sequence hands it each token as it is appended and ends when a stop string appears, so the
engine retires it like any other finished sequence and nobody has to call back down.
"""

import codecs
from collections.abc import Sequence

import tiktoken


class TextStream:
    def __init__(self, tokenizer: tiktoken.Encoding, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded, not yet released
        self._taken = 0  # characters of `text` handed out by take()
        self.text = ""  # released so far
        self.stopped = False  # a stop string was found

    def stops_at(self, token_id: int, may_stop: bool = True) -> bool:
        """The stop checker: take a token; whether its text completes a stop string."""
        self.push(token_id, may_stop)
        return self.stopped

    def push(self, token_id: int, may_stop: bool = True) -> str:
        """The text this token releases ('' if none). With `may_stop` False (the sequence is short of
        its min_tokens) stop strings are not looked for, as vLLM does; text that may begin one is still
        held, so one completed by a later token is found."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(self._tokenizer.decode_single_token_bytes(token_id))
        return self._release(search=may_stop)

    def finish(self) -> str:
        """Release everything still held: the sequence has ended (its end was decided already)."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(b"", final=True)
        out, self._held = self._held, ""
        self.text += out
        return out

    def take(self) -> str:
        """The text released since the last take()."""
        out, self._taken = self.text[self._taken :], len(self.text)
        return out

    def _release(self, search: bool) -> str:
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0] if search else []
        if hits:
            out, self._held, self.stopped = self._held[: min(hits)], "", True
        else:
            keep = self._stop_prefix_length()
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.text += out
        return out

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the held text that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:n]):
                    longest = n
                    break
        return longest
