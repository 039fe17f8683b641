"""Text: the checkpoint's tokenizer, streaming detokenisation, the chat format and sampling.

    tokenizer.py   Tokenizer (tokenizer.json via HF tokenizers), find_tokenizer, GenerationDefaults
    stream.py      TextStream: complete UTF-8 text as tokens arrive
    chat.py        render_chat, chat_prompt_ids: DeepSeek-V4's prompt format
    sampling.py    SamplingParams, Sampler: greedy, temperature, top-k, min-p, top-p, seed
    synthetic.py   the synthetic checkpoints' tokenizer (a byte-level BPE trained on corpus.txt)
"""
from __future__ import annotations

from ds4f.engine.text.chat import chat_prompt_ids, render_chat
from ds4f.engine.text.sampling import Sampler, SamplingParams
from ds4f.engine.text.stream import TextStream
from ds4f.engine.text.tokenizer import GenerationDefaults, Tokenizer, find_tokenizer

__all__ = ["GenerationDefaults", "Sampler", "SamplingParams", "TextStream", "Tokenizer", "chat_prompt_ids",
           "find_tokenizer", "render_chat"]
