"""Generated tokens to text as they arrive: whole characters only, and stop strings cut out.

A character can span several tokens; an incremental UTF-8 decoder holds its first bytes
back until it is complete, so a stream never carries a broken character. Text that could
still turn into a stop string is held back too, and the stop string is never emitted.

A TextStream is also its sequence's stop checker (generate.sequence.StopChecker): the
sequence hands it each token as it is appended and ends when a stop string appears, so the
engine retires it like any other finished sequence and nobody has to call back down.

This runs on the loop's thread, for every token of every request, so its cost per token is bounded
by what the token brings: each stop string is followed by a Knuth-Morris-Pratt automaton that reads
each new character once (amortised constant time), and knows how much of the stop string the text
ends with, which is what must be held back. Slicing every prefix of every stop string against the
held text instead cost the square of a stop string's length at each token.
"""

import codecs
from collections.abc import Sequence

import tiktoken


class StopMatcher:
    """One stop string's automaton: `matched` is the length of the longest prefix of the stop string that
    the text read so far ends with."""

    def __init__(self, stop: str):
        self.stop, self.matched = stop, 0
        self._border = _borders(stop)

    def read(self, char: str) -> bool:
        """Take the text's next character; whether it completes the stop string (the automaton then goes on
        as if it had not, for occurrences that overlap this one)."""
        matched, stop = self.matched, self.stop
        while matched and stop[matched] != char:
            matched = self._border[matched - 1]
        if stop[matched] == char:
            matched += 1
        complete = matched == len(stop)
        self.matched = self._border[matched - 1] if complete else matched
        return complete


def _borders(text: str) -> list[int]:
    """For each prefix of `text`, the length of its longest proper prefix that is also its suffix (KMP's table)."""
    border = [0] * len(text)
    for i in range(1, len(text)):
        k = border[i - 1]
        while k and text[i] != text[k]:
            k = border[k - 1]
        border[i] = k + (text[i] == text[k])
    return border


class TextStream:
    def __init__(self, tokenizer: tiktoken.Encoding, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop_strings = tuple(s for s in stop if s)
        self._stop = [StopMatcher(s) for s in self.stop_strings]
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
        return self._release(self._utf8.decode(self._tokenizer.decode_single_token_bytes(token_id)), may_stop)

    def push_many(self, token_ids: Sequence[int]) -> str:
        """push() of several tokens in one decode (a completion's tokens that come together): only where no stop
        string is looked for, which push() does token by token, each at its own min_tokens."""
        assert not self._stop, "stop strings are looked for token by token"
        if self.stopped:
            return ""
        return self._release(self._utf8.decode(self._tokenizer.decode_bytes(token_ids)), False)

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

    def _release(self, new: str, search: bool) -> str:
        """Hold the new text, then release what can no longer be part of a stop string: up to the earliest
        stop string completed by it (and stop), else all but the longest tail that begins one."""
        if not self._stop:  # nothing is ever held: a streamed token's text costs no walk over its characters
            self.text += new
            return new
        self._held += new
        cut = None
        for i, char in enumerate(new, len(self._held) - len(new) + 1):  # i: the held length up to this char
            for matcher in self._stop:
                if matcher.read(char) and search:
                    cut = min(i - len(matcher.stop), i if cut is None else cut)
        if cut is not None:
            out, self._held, self.stopped = self._held[:cut], "", True
        else:
            keep = max((matcher.matched for matcher in self._stop), default=0)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.text += out
        return out


class FaultyTextStream(TextStream):
    """Fault injection for tests (FAULT_FAIL_MARKER): raises at its sequence's first token, inside the engine's
    step, as a failing stop checker would."""

    def stops_at(self, token_id: int, may_stop: bool = True) -> bool:
        raise RuntimeError("fault injected by FAULT_FAIL_MARKER")
