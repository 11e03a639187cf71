"""Write a stand-in tokenizer.json for a random-weight Qwen3 checkpoint (no downloads here).

Byte-level BPE without merges: ids 0..255 are the 256 byte symbols, every other id up to the
model's vocab is a filler token "<|xN|>", and <|endoftext|> / <|im_end|> sit at Qwen3's ids
151643 / 151645. So every id a random model samples decodes, prompts encode to bytes, and the
config's EOS is a real token. Run: python3 benchmarks/make_tokenizer.py MODEL_DIR [VOCAB]
"""

from __future__ import annotations

import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def main() -> None:
    out = sys.argv[1]
    vocab_size = int(sys.argv[2]) if len(sys.argv) > 2 else 151936
    specials = {151643: "<|endoftext|>", 151645: "<|im_end|>"}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(alphabet), vocab_size):
        vocab[specials.get(i, f"<|x{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    tok.save(f"{out}/tokenizer.json")


if __name__ == "__main__":
    main()
