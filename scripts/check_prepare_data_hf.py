#!/usr/bin/env python3
"""prepare_data.py with a real Hugging Face tokenizer and chat template (needs transformers and
tokenizers: run it on the GPU machine; the byte tokenizer path is tested in CI).

Builds a small word-level tokenizer from tests/fixtures/data/input.jsonl with a chat template,
saves it as a transformers tokenizer directory, runs prepare_data.py with it, reads the dataset
back (its own reader of the MMIDIDX format) and checks:
  - every document decodes to its text, or to the template's rendering of its messages;
  - in chats, the target tokens (mask 1) are exactly the assistant contents (plus their end
    marker and the final eos) and nothing else.
    python3 scripts/check_prepare_data_hf.py [WORK_DIR]
Exit 0 on success.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUT = os.path.join(REPO, "tests", "fixtures", "data", "input.jsonl")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def words(text):
    return pre_tokenizers.WhitespaceSplit().pre_tokenize_str(text)


def build_tokenizer(directory, records):
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    def add(text):
        for word, _ in words(text):
            vocab.setdefault(word, len(vocab))
    for r in records:
        if "text" in r:
            add(r["text"])
        for m in r.get("messages", []):
            add("<|%s|> %s <|end|>" % (m["role"], m["content"]))
    add("<|assistant|>")
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(directory)
    return tok


def read_dataset(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "bad magic"
    version, dtype_code, sequences, doc_len = struct.unpack_from("<QBQQ", idx, 9)
    assert version == 1
    offset = 9 + 8 + 1 + 8 + 8
    sizes = struct.unpack_from("<%di" % sequences, idx, offset)
    offset += 4 * sequences
    pointers = struct.unpack_from("<%dq" % sequences, idx, offset)
    width, code = {8: (2, "H"), 4: (4, "i")}[dtype_code]
    data = open(prefix + ".bin", "rb").read()
    mask = open(prefix + ".mask", "rb").read()
    docs = []
    for size, pointer in zip(sizes, pointers):
        tokens = list(struct.unpack_from("<%d%s" % (size, code), data, pointer))
        first = pointer // width
        docs.append((tokens, list(mask[first:first + size])))
    return docs


def main():
    work = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="moetrain_prepare_")
    records = [json.loads(line) for line in open(INPUT) if line.strip()]
    tok_dir = os.path.join(work, "tokenizer")
    tok = build_tokenizer(tok_dir, records)
    prefix = os.path.join(work, "data")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "prepare_data.py"), "--input", INPUT,
                    "--tokenizer", tok_dir, "--output", prefix], check=True)
    docs = read_dataset(prefix)
    assert len(docs) == len(records), "%d documents for %d records" % (len(docs), len(records))
    problems = 0
    eos = tok.eos_token_id
    for i, (record, (tokens, mask)) in enumerate(zip(records, docs)):
        if "text" in record:
            expected = tok.encode(record["text"], add_special_tokens=False) + [eos]
            expected_targets = expected
        else:
            expected = list(tok.apply_chat_template(record["messages"], tokenize=True, return_dict=False)) + [eos]
            expected_targets = []
            for m in record["messages"]:
                if m["role"] == "assistant":
                    expected_targets += tok.encode("%s <|end|>" % m["content"], add_special_tokens=False)
            if record["messages"][-1]["role"] == "assistant":
                expected_targets.append(eos)
        targets = [t for t, m in zip(tokens, mask) if m]
        if tokens != expected or targets != expected_targets:
            problems += 1
            print("document %d: tokens %s\n  expected %s\n  targets %s\n  expected targets %s"
                  % (i, tokens, expected, targets, expected_targets))
    chats = sum("messages" in r for r in records)
    print("check_prepare_data_hf: %d documents (%d chats) with a transformers tokenizer and chat template: %s"
          % (len(docs), chats, "OK" if problems == 0 else "%d MISMATCHED" % problems))
    return 0 if problems == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
