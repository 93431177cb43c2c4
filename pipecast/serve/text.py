"""Text in and out of the engine: the package's tokenizer, incremental detokenization and stop strings.

Tokens arrive one at a time and a token need not end on a character boundary (byte-level BPE splits
UTF-8 characters across tokens; SentencePiece drops a word's leading space when it is decoded alone).
:class:`IncrementalDetokenizer` decodes a short window of recent tokens and emits only the text that is
final; :class:`StopMatcher` holds back text that may be the start of a stop string. Both are pure: they
take a :class:`TextCodec`-like object with ``decode``.
"""

import tempfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipecast.serve.errors import ModelUnavailableError, RequestFieldError

# Tokens of the prompt decoded with the first generated ones, so a leading space comes out right.
PROMPT_CONTEXT_TOKENS = 5
#: Tokens held back at most while their text is incomplete or has not grown: no character takes more (a byte-level
#: tokenizer spends one token a byte, 4 at most); beyond, they come out as they decode (replacement characters, or
#: nothing for skipped special tokens) instead of being decoded again with every token after them.
MAX_HELD_TOKENS = 16
_INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that are not a whole UTF-8 character (yet)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
NORMALIZER_SLACK = 4


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens left out)."""


class TextCodec:
    """The package's tokenizer (transformers' ``AutoTokenizer``): prompts to token ids and back."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # The most characters one token can stand for (its vocabulary string, added tokens included; a
        # byte-level vocabulary spells a byte as one character, so a token covers at most that many
        # characters of text). Computed once, on the loader's thread.
        self.max_token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1) or 1

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, without tokenizing it: with the vocabulary's longest
        token at most every ``max_token_chars`` characters, and a slack of 4 for normalizers that compose
        characters (NFKC), ``text`` cannot take fewer."""
        return len(text) // (NORMALIZER_SLACK * self.max_token_chars)

    @classmethod
    def from_files(cls, read: Callable[[str], bytes | None], names: Sequence[str], where: str) -> "TextCodec":
        """Load the tokenizer from a package's small files ``names``, each read with ``read(name)``.

        Raises :class:`ModelUnavailableError` when the package has no tokenizer, or files transformers cannot
        load one from (the package's fault either way).
        """
        from transformers import AutoTokenizer

        if not any(name in TOKENIZER_FILES for name in names):
            raise ModelUnavailableError(f"{where} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): the serving "
                                        "worker needs one to read prompts and write text")
        with tempfile.TemporaryDirectory(prefix="pipecast-tokenizer-") as folder:
            for name in names:
                data = read(name)
                if data is not None:
                    path = Path(folder) / name
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
            try:
                return cls(AutoTokenizer.from_pretrained(folder))
            except Exception as exc:  # the package's files: JSON of the wrong shape raises KeyError, TypeError, ...
                raise ModelUnavailableError(f"{where}: its tokenizer files cannot be loaded "
                                            f"({type(exc).__name__}: {exc})") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt (with the special tokens the tokenizer adds, e.g. BOS)."""
        return list(self.tokenizer(text)["input_ids"])

    def chat_ids(self, messages: Sequence[Any]) -> list[int]:
        """Token ids of chat ``messages`` (each with ``role`` and ``content``) through the model's chat
        template, ending with the assistant's turn to answer; :class:`RequestFieldError` when the model has
        no chat template or the template refuses the messages (e.g. roles that do not alternate)."""
        from jinja2 import TemplateError

        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except TemplateError as exc:
            raise RequestFieldError("messages", f"the model's chat template refused them: {exc}") from None
        except ValueError as exc:  # transformers: no chat template in the package
            raise RequestFieldError("messages", f"this model cannot chat: {exc}") from None
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens (EOS) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns generated tokens into text deltas whose concatenation is the decoded text of the generation."""

    def __init__(self, codec: Decoder, prompt: Sequence[int]) -> None:
        self._codec = codec
        self._ids = list(prompt[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0                 # the window decoded starts here
        self._read = len(self._ids)      # tokens before this are already emitted
        self._held = ""                  # see held()

    def add(self, token: int) -> str:
        """Text that ``token`` completes ("" while a character is split across tokens)."""
        self._ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left at the end (an incomplete character comes out as the replacement character)."""
        return self._advance(final=True)

    def held(self) -> str:
        """The settled text held back, not yet returned: what the tokens since the last delta decode to, less
        the replacement characters at its end (the character a token left incomplete, e.g. a token "x" plus
        the first byte of "中"). It comes out, whole, once that character completes."""
        return self._held

    def _advance(self, final: bool) -> str:
        self._held = ""
        if self._read == len(self._ids):
            return ""
        before = self._codec.decode(self._ids[self._prefix:self._read])
        if before.endswith(_INCOMPLETE):
            # The window's emitted tokens end in an incomplete character (the prompt's tail, or tokens a forced
            # emission let out): their text is no prefix of what they decode to with the next tokens (a
            # ByteFallback decoder gives one U+FFFD per byte until the character completes, then one character),
            # so slicing at len(before) would drop real text. Decode from the first token not yet emitted.
            self._prefix, before = self._read, ""
        text = self._codec.decode(self._ids[self._prefix:])
        settling = len(self._ids) - self._read <= MAX_HELD_TOKENS
        if not final and settling and (len(text) <= len(before) or text.endswith(_INCOMPLETE)):
            self._held = text[len(before):].rstrip(_INCOMPLETE)
            return ""
        # Let out what the held tokens decode to; the last one, when the text ends incomplete, stays: it may begin
        # a character the next tokens complete.
        end = len(self._ids) - int(not final and text.endswith(_INCOMPLETE))
        if end < len(self._ids):
            text = self._codec.decode(self._ids[self._prefix:end])
        self._prefix, self._read = self._read, end
        return text[len(before):]


class StopMatcher:
    """Cuts generated text at the first stop string; holds back the end of the text while it may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._pending = ""
        self.stopped = False
        """True once a stop string was found (the text before it has been returned)."""

    def feed(self, text: str, ahead: str = "") -> str:
        """The part of ``text`` (after what is held back) that is sure to be output. ``ahead`` is text known
        to follow ``text`` but not handed over yet (the detokenizer's :meth:`~IncrementalDetokenizer.held`):
        a stop string ending in it stops now, and its text before the stop is output; else it is left for a
        later ``feed``."""
        if self.stopped:
            return ""
        self._pending += text
        seen = self._pending + ahead
        cut = min((i for i in (seen.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = seen[:cut], ""
            return out
        keep = self._partial_stop_length()
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out

    def _partial_stop_length(self) -> int:
        """Length of the longest end of the pending text that begins a stop string."""
        pending = self._pending
        # per stop, the longest first: held-back text that keeps matching costs len(stop) checks, not their square
        return max((next((k for k in range(min(len(stop) - 1, len(pending)), 0, -1) if pending.endswith(stop[:k])),
                         0) for stop in self._stops), default=0)

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class CompletionText:
    """The text of one completion as tokens arrive: detokenized, then cut at a stop string; the stop token
    (``stop_token_ids``) that ends a generation adds no text."""

    def __init__(self, codec: Decoder, prompt: Sequence[int], stops: Sequence[str],
                 stop_token_ids: Collection[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(codec, prompt)
        self._stops = StopMatcher(stops)
        self._stop_token_ids = stop_token_ids

    @property
    def stopped(self) -> bool:
        """True once a stop string ended the completion (no more tokens should be generated)."""
        return self._stops.stopped

    def add(self, token: int) -> str:
        """The new output text after ``token``."""
        # The engine ends a generation at a stop token (finish_reason "stop"); as vLLM does, its text (an EOS
        # the tokenizer does not mark special, e.g. a fine-tune's turn end) is no part of the answer.
        if token in self._stop_token_ids:
            return ""
        text = self._detokenizer.add(token)
        # The stops are checked against the settled text too: a token completing a stop string may also
        # begin a character the next tokens complete, and generation must end at that token, not later.
        return self._stops.feed(text, self._detokenizer.held())

    def finish(self) -> str:
        """The rest of the output once generation has ended."""
        return self._stops.feed(self._detokenizer.flush()) + self._stops.flush()
