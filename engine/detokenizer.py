"""A request's text: its output ids decoded, and stop strings found in it.

The text is decoded whole from the output ids at each step (special tokens skipped), so a token
that completes a multi-byte character shows when it completes it. A stop string's cut is final:
later decodes leave the text as it is. A stop token that ended the request is in its output ids
but never in its text.
"""

from __future__ import annotations

from typing import Callable

from kvcache.engine.request import FinishReason, Request


class Detokenizer:
    def __init__(self, tokenizer, is_stop_token: Callable[[Request, int], bool]):
        self.tokenizer, self.is_stop_token = tokenizer, is_stop_token

    def stop_string(self, req: Request) -> bool:
        """Whether the request's text now holds one of its stop strings (the text is cut there)."""
        if not req.params.stop or self.tokenizer is None:
            return False
        self.update(req)
        for s in req.params.stop:
            at = req.text.find(s)
            if at >= 0:
                req.text, req.text_cut = req.text[:at], True
                return True
        return False

    def update(self, req: Request) -> None:
        """req.text from its output (nothing without a tokenizer, or once a stop string cut it)."""
        if self.tokenizer is None or req.text_cut:
            return
        out = req.output
        if req.finish_reason is FinishReason.STOP and out and self.is_stop_token(req, out[-1]):
            out = out[:-1]
        req.text = self.tokenizer.decode(out, skip_special=True)
