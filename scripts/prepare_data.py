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

Images (Kimi K3's vision tower, model.vision): a message's `content` may be a list of parts, the
OpenAI / Hugging Face form: {"type": "text", "text": "..."} and {"type": "image", "image": PATH}
(PATH relative to the JSONL file's directory). Such chats use the simple template; an image part
becomes one placeholder token (--image-token-id; 163605, Kimi K3's media_placeholder_token_id, or
258 with `bytes`, which then has a vocabulary of 259) per text-side token, with loss mask 0. The
image (decoded by Pillow, RGB) is resized keeping its aspect ratio to at most --max-pixels pixels,
each side a multiple of 28 (--patch-size 14 x --merge-size 2; bicubic), normalised as
(value / 255 - 0.5) / 0.5 per channel, and cut into 14 x 14 patches in raster order, each patch
channel-major ([c][y][x]); it becomes (height / 28) x (width / 28) placeholders. An image that
cannot be read or is truncated ends the run with exit code 3, naming the file and the record.

Output files (little-endian):
  <out>.idx   b"MMIDIDX\\0\\0", uint64 version 1, uint8 dtype code (8 uint16 when the vocabulary
              fits, else 4 int32), uint64 sequences S, uint64 document-index length S + 1,
              int32 sizes[S], int64 byte pointers[S], int64 document index [0, 1, ..., S]
  <out>.bin   the tokens
  <out>.mask  one byte per token of <out>.bin: 1 = a training target, 0 = context only
  with images, also
  <out>.patches  float32: every image's patches, in document order
  <out>.images   b"MTIMAGES", uint64 version 1, uint64 values per patch (3 p^2), uint64 placeholder
                 token id, uint64 documents D, uint64 images N, int64 first image of each document
                 [D + 1], then per image: int32 grid (frames, rows, columns of patches) [N x 3],
                 int64 first placeholder's token offset in its document [N], int32 placeholders [N],
                 int64 first patch [N + 1]
Only the standard library is needed (numpy is not used), and Pillow for images.
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
IMAGES_MAGIC = b"MTIMAGES"
K3_IMAGE_TOKEN = 163605
EXIT_BAD_DATA = 3


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


class ImageEncoder:
    """Images as the tower's patches: resized, normalised, cut (the module docstring's rule)."""

    def __init__(self, args, base_dir):
        self.patch, self.merge, self.max_pixels = args.patch_size, args.merge_size, args.max_pixels
        self.token_id = args.image_token_id
        self.base_dir = base_dir
        self.patches = array.array("f")
        self.grids = []  # per image: (frames, rows, columns, placeholders, first patch)

    def target_size(self, width, height):
        side = self.patch * self.merge
        scale = min(1.0, (self.max_pixels / float(width * height)) ** 0.5)
        w = max(side, int(round(width * scale / side)) * side)
        h = max(side, int(round(height * scale / side)) * side)
        while w * h > self.max_pixels and (w > side or h > side):  # rounding up went over the budget
            if w >= h:
                w -= side
            else:
                h -= side
        return w, h

    def encode(self, path, where):
        """The image's placeholders; its patches and grid are kept for the .patches/.images files."""
        try:
            from PIL import Image  # noqa: PLC0415 - only runs with images
        except ImportError:
            sys.exit(where + ": an image part needs Pillow (python3-pil), which this Python lacks")
        full = path if os.path.isabs(path) else os.path.join(self.base_dir, path)
        try:
            with Image.open(full) as img:
                img.load()
                rgb = img.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            print("error: {}: image {} cannot be read: {}".format(where, full, e), file=sys.stderr)
            sys.exit(EXIT_BAD_DATA)
        w, h = self.target_size(*rgb.size)
        rgb = rgb.resize((w, h), Image.BICUBIC)
        data = rgb.tobytes()  # rows of (r, g, b) bytes
        p = self.patch
        first = len(self.patches) // (3 * p * p)
        for r in range(h // p):
            for c in range(w // p):
                for ch in range(3):
                    for y in range(p):
                        row = ((r * p + y) * w + c * p) * 3 + ch
                        self.patches.extend((data[row + 3 * x] / 255.0 - 0.5) / 0.5 for x in range(p))
        tokens = (h // (p * self.merge)) * (w // (p * self.merge))
        self.grids.append((1, h // p, w // p, tokens, first))
        return [self.token_id] * tokens


def content_tokens(tokenizer, content, images, where):
    """A message's content (a string, or a list of text and image parts) as tokens and, per token,
    whether it is an image placeholder."""
    if isinstance(content, str):
        t = tokenizer.encode(content)
        return t, [False] * len(t)
    tokens, is_image = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            t = tokenizer.encode(part["text"])
            tokens += t
            is_image += [False] * len(t)
        elif kind == "image" and isinstance(part.get("image"), str):
            if images is None:
                sys.exit(where + ": image parts need the simple chat template (--simple-chat-template, or "
                         "--tokenizer bytes)")
            t = images.encode(part["image"], where)
            tokens += t
            is_image += [True] * len(t)
        else:
            sys.exit(where + ': a content part must be {"type": "text", "text": STRING} or '
                     '{"type": "image", "image": PATH}')
    return tokens, is_image


def image_chat(tokenizer, messages, images, where):
    """The simple template over content parts: tokens, mask, and each image's token offset."""
    tokens, mask, offsets = [], [], []
    for message in messages:
        header = tokenizer.encode("<|" + message["role"] + "|>\n")
        body, is_image = content_tokens(tokenizer, message["content"], images, where)
        newline = tokenizer.encode("\n")
        target = 1 if message["role"] == "assistant" else 0
        start = len(tokens) + len(header)
        for i, flag in enumerate(is_image):
            if flag and (i == 0 or not is_image[i - 1]):
                offsets.append(start + i)
        tokens += header + body + newline
        mask += [0] * len(header) + [0 if f else target for f in is_image] + [target] * len(newline)
    return tokens, mask, offsets


def document(tokenizer, record, args, where, images=None):
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
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), (str, list)):
                sys.exit(where + ": every message needs a string `role` and a `content` (a string or a list of parts)")
        if any(isinstance(m["content"], list) for m in messages):
            templated = tokenizer.chat_template and not args.simple_chat_template
            first_image = len(images.grids) if images is not None else 0
            tokens, mask, offsets = image_chat(tokenizer, messages, None if templated else images, where)
            if images is not None:
                for k, offset in enumerate(offsets):
                    images.grids[first_image + k] += (offset,)
        elif tokenizer.chat_template and not args.simple_chat_template:
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


def write_images(prefix, images, doc_first_image):
    """<prefix>.patches and <prefix>.images (the module docstring's layout)."""
    with open(prefix + ".patches", "wb") as f:
        f.write(little_endian(images.patches))
    values = 3 * images.patch * images.patch
    with open(prefix + ".images", "wb") as f:
        f.write(IMAGES_MAGIC)
        f.write(struct.pack("<QQQQQ", 1, values, images.token_id, len(doc_first_image) - 1, len(images.grids)))
        f.write(little_endian(array.array("q", doc_first_image)))
        f.write(little_endian(array.array("i", [v for g in images.grids for v in g[:3]])))
        f.write(little_endian(array.array("q", [g[5] for g in images.grids])))
        f.write(little_endian(array.array("i", [g[3] for g in images.grids])))
        f.write(little_endian(array.array("q", [g[4] for g in images.grids] + [len(images.patches) // values])))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, nargs="+", help="JSONL file(s), one document per line")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory, or `bytes`")
    parser.add_argument("--output", required=True, help="output prefix: writes PREFIX.bin, .idx and .mask")
    parser.add_argument("--no-eos", action="store_true", help="do not end documents with the eos token")
    parser.add_argument("--simple-chat-template", action="store_true",
                        help="use the simple template even when the tokenizer has a chat template")
    parser.add_argument("--image-token-id", type=int, default=None,
                        help="the image placeholder token (default 163605, Kimi K3's; 258 with bytes)")
    parser.add_argument("--max-pixels", type=int, default=896 * 896, help="pixel budget per image (896 x 896)")
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--merge-size", type=int, default=2)
    args = parser.parse_args()

    tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else HfTokenizer(args.tokenizer)
    vocab_size = tokenizer.vocab_size
    if args.image_token_id is None:
        args.image_token_id = BYTES_VOCAB if args.tokenizer == "bytes" else K3_IMAGE_TOKEN
    images = ImageEncoder(args, ".")
    doc_first_image = [0]
    if args.tokenizer != "bytes" and not args.no_eos and tokenizer.eos_token_id is None:
        print("warning: the tokenizer has no eos token; documents end without one", file=sys.stderr)
    documents = []
    for path in args.input:
        try:
            f = open(path, "rb")
        except OSError as e:
            sys.exit("error: cannot read --input {}: {}".format(path, e.strerror))
        with f:
            images.base_dir = os.path.dirname(os.path.abspath(path))
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
                before = len(images.grids)
                tokens, mask = document(tokenizer, record, args, where, images)
                if tokens:
                    documents.append((tokens, mask))
                    doc_first_image.append(len(images.grids))
                elif len(images.grids) != before:
                    sys.exit(where + ": a document of images alone has no tokens")
    if not documents:
        sys.exit("error: no documents in " + ", ".join(args.input))
    if images.grids:
        if args.tokenizer == "bytes":
            vocab_size = max(vocab_size, args.image_token_id + 1)
        elif args.image_token_id >= vocab_size:
            sys.exit("error: --image-token-id {} is outside the tokenizer's vocabulary of {}".format(
                args.image_token_id, vocab_size))
    try:
        write_dataset(args.output, documents, vocab_size)
        if images.grids:
            write_images(args.output, images, doc_first_image)
    except OSError as e:
        sys.exit("error: cannot write --output {} ({}.bin/.idx/.mask): {}".format(
            args.output, args.output, e.strerror))
    total = sum(len(t) for t, _ in documents)
    targets = sum(sum(m) for _, m in documents)
    print("wrote {}.bin/.idx/.mask: {} documents, {} tokens, {} with loss mask 1 ({:.1%}), vocabulary {}".format(
        args.output, len(documents), total, targets, targets / total, vocab_size))
    if images.grids:
        print("wrote {}.patches/.images: {} images, {} patches, placeholder token {}".format(
            args.output, len(images.grids), len(images.patches) // (3 * args.patch_size ** 2), args.image_token_id))
    if targets == 0:
        print("warning: no token is a training target (every loss-mask byte is 0: no document has an assistant "
              "turn or text); moetrain refuses to train on this data alone", file=sys.stderr)


if __name__ == "__main__":
    main()
