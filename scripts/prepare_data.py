#!/usr/bin/env python3
"""Tokenize JSONL into a moetrain dataset: <out>.bin + <out>.idx (Megatron MMIDIDX) + <out>.mask.

Each input line is one document, either
  {"text": "..."}                                    every token is a training target, or
  {"messages": [{"role": "user", "content": "..."},  a chat: only the assistant turns are
                {"role": "assistant", "content": "..."}, ...]}   targets (loss mask 1)

Usage:
  python3 scripts/prepare_data.py --input data.jsonl --tokenizer /path/to/hf_model_dir --output data/train
  python3 scripts/prepare_data.py --input data.jsonl --tokenizer bytes --output data/train

then train with `--set data.source=data/train` (docs/DATA.md has the details).

Tokenizers:
  a Hugging Face directory  loaded with transformers.AutoTokenizer (or, without transformers,
                            tokenizers.Tokenizer from <dir>/tokenizer.json). Chats use the
                            tokenizer's chat template when it has one, else the simple template.
  bytes                     no dependencies: token id = byte value + 2 of the UTF-8 text, 1 = end of
                            document, 0 = padding (never written); vocabulary 258.

The simple chat template (used with `bytes`, or a tokenizer without a chat template):
  for each message: "<|" + role + "|>\\n" + content + "\\n"
with the loss mask 1 on an assistant message's content and its closing "\\n", 0 elsewhere.
An end-of-document token (the tokenizer's eos, or 1 for bytes) ends every document unless
--no-eos; it is a target when the document's last message is the assistant's (or for text).

Output files (little-endian):
  <out>.idx   b"MMIDIDX\\0\\0", uint64 version 1, uint8 dtype code (8 uint16 when the vocabulary
              fits, else 4 int32), uint64 sequences S, uint64 document-index length S + 1,
              int32 sizes[S], int64 byte pointers[S], int64 document index [0, 1, ..., S]
  <out>.bin   the tokens
  <out>.mask  one byte per token of <out>.bin: 1 = a training target, 0 = context only
Only the standard library is needed (numpy is not used).
"""
import argparse
import array
import json
import os
import struct
import sys

BYTES_OFFSET = 2
BYTES_EOS = 1
BYTES_VOCAB = 256 + BYTES_OFFSET
MAGIC = b"MMIDIDX\x00\x00"
DTYPE_INT32 = 4
DTYPE_UINT16 = 8


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 2; 1 ends a document."""

    vocab_size = BYTES_VOCAB
    eos_token_id = BYTES_EOS
    chat_template = None

    def encode(self, text):
        return [b + BYTES_OFFSET for b in text.encode("utf-8")]


class HfTokenizer:
    """A Hugging Face tokenizer directory, through transformers or the tokenizers library."""

    def __init__(self, path):
        self.chat_template = None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        if AutoTokenizer is not None:
            self.tok = AutoTokenizer.from_pretrained(path)
            self.vocab_size = len(self.tok)
            self.eos_token_id = self.tok.eos_token_id
            self.chat_template = getattr(self.tok, "chat_template", None)
            self._encode = lambda text: self.tok.encode(text, add_special_tokens=False)
            return
        try:
            from tokenizers import Tokenizer
        except ImportError:
            sys.exit("error: --tokenizer " + path + " needs the `transformers` or `tokenizers` package "
                     "(pip install transformers), or use --tokenizer bytes")
        self.tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = None
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos is not None:
                self.eos_token_id = self.tok.token_to_id(eos)
        self._encode = lambda text: self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, text):
        return list(self._encode(text))

    def apply_chat_template(self, messages, add_generation_prompt):
        # return_dict=False: token ids, not a BatchEncoding (whose default changed in transformers 5).
        return list(self.tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt))


def simple_chat(tokenizer, messages):
    """The documented simple template: tokens and mask."""
    tokens, mask = [], []
    for message in messages:
        header = tokenizer.encode("<|" + message["role"] + "|>\n")
        body = tokenizer.encode(message["content"] + "\n")
        target = 1 if message["role"] == "assistant" else 0
        tokens += header + body
        mask += [0] * len(header) + [target] * len(body)
    return tokens, mask


def templated_chat(tokenizer, messages, where):
    """The tokenizer's own chat template. Assistant message i's tokens are those the rendering of
    messages[:i+1] adds to the rendering of messages[:i] with the generation prompt; the template
    must render prefixes consistently for that (most do; we check)."""
    tokens, mask = [], []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            if prompt[:len(tokens)] != tokens:
                sys.exit(where + ": the chat template does not render message prefixes consistently; "
                         "use --simple-chat-template")
            mask += [0] * (len(prompt) - len(tokens))
            tokens = prompt
        full = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if full[:len(tokens)] != tokens:
            sys.exit(where + ": the chat template does not render message prefixes consistently; "
                     "use --simple-chat-template")
        mask += [1 if message["role"] == "assistant" else 0] * (len(full) - len(tokens))
        tokens = full
    return tokens, mask


def document(tokenizer, record, args, where):
    if "text" in record:
        if not isinstance(record["text"], str):
            sys.exit(where + ": `text` must be a string")
        tokens = tokenizer.encode(record["text"])
        mask = [1] * len(tokens)
        last_is_target = True
    elif "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            sys.exit(where + ": `messages` must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                sys.exit(where + ": every message needs a string `role` and `content`")
        if tokenizer.chat_template and not args.simple_chat_template:
            tokens, mask = templated_chat(tokenizer, messages, where)
        else:
            tokens, mask = simple_chat(tokenizer, messages)
        last_is_target = messages[-1]["role"] == "assistant"
    else:
        sys.exit(where + ': expected {"text": ...} or {"messages": [...]}')
    if not args.no_eos and tokenizer.eos_token_id is not None:
        tokens.append(tokenizer.eos_token_id)
        mask.append(1 if last_is_target else 0)
    return tokens, mask


def little_endian(arr):
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def write_dataset(prefix, documents, vocab_size):
    dtype_code, typecode = (DTYPE_UINT16, "H") if vocab_size <= 65536 else (DTYPE_INT32, "i")
    itemsize = array.array(typecode).itemsize
    sizes, pointers, offset = [], [], 0
    directory = os.path.dirname(prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(prefix + ".bin", "wb") as bin_file, open(prefix + ".mask", "wb") as mask_file:
        for tokens, mask in documents:
            bin_file.write(little_endian(array.array(typecode, tokens)))
            mask_file.write(bytes(mask))
            sizes.append(len(tokens))
            pointers.append(offset)
            offset += len(tokens) * itemsize
    with open(prefix + ".idx", "wb") as idx:
        idx.write(MAGIC)
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", dtype_code))
        idx.write(struct.pack("<Q", len(sizes)))
        idx.write(struct.pack("<Q", len(sizes) + 1))
        idx.write(little_endian(array.array("i", sizes)))
        idx.write(little_endian(array.array("q", pointers)))
        idx.write(little_endian(array.array("q", range(len(sizes) + 1))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="JSONL file(s), one document per line")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory, or `bytes`")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, .idx and .mask")
    parser.add_argument("--no-eos", action="store_true", help="do not end documents with the eos token")
    parser.add_argument("--simple-chat-template", action="store_true",
                        help="use the simple template even when the tokenizer has a chat template")
    args = parser.parse_args()

    tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else HfTokenizer(args.tokenizer)
    if args.tokenizer != "bytes" and not args.no_eos and tokenizer.eos_token_id is None:
        print("warning: the tokenizer has no eos token; documents end without one", file=sys.stderr)
    documents = []
    for path in args.input:
        try:
            f = open(path, "rb")
        except OSError as e:
            sys.exit("error: cannot read --input {}: {}".format(path, e.strerror))
        with f:
            for number, raw in enumerate(f, 1):
                where = "{}:{}".format(path, number)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    sys.exit("{}: not UTF-8 (byte {} of the line is 0x{:02x}); convert the file to UTF-8, e.g. "
                             "iconv -f latin1 -t utf-8".format(where, e.start + 1, raw[e.start]))
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(where + ": not valid JSON (" + str(e) + ")")
                if not isinstance(record, dict):
                    sys.exit(where + ": expected a JSON object")
                tokens, mask = document(tokenizer, record, args, where)
                if tokens:
                    documents.append((tokens, mask))
    if not documents:
        sys.exit("error: no documents in " + ", ".join(args.input))
    try:
        write_dataset(args.output, documents, tokenizer.vocab_size)
    except OSError as e:
        sys.exit("error: cannot write --output {} ({}.bin/.idx/.mask): {}".format(
            args.output, args.output, e.strerror))
    total = sum(len(t) for t, _ in documents)
    targets = sum(sum(m) for _, m in documents)
    print("wrote {}.bin/.idx/.mask: {} documents, {} tokens, {} with loss mask 1 ({:.1%}), vocabulary {}".format(
        args.output, len(documents), total, targets, targets / total, tokenizer.vocab_size))
    if targets == 0:
        print("warning: no token is a training target (every loss-mask byte is 0: no document has an assistant "
              "turn or text); moetrain refuses to train on this data alone", file=sys.stderr)


if __name__ == "__main__":
    main()
